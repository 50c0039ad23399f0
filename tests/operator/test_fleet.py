"""Fleet operation on the real control plane: two operator replicas with leader election (kill the leader,
the standby takes over, nothing is done twice), the operator's metrics, and RBAC that is exactly what the
code calls (`kubectl auth can-i --list` as the operator's service account)."""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from tests.cluster.controlplane import register_nodes, spyre_nodes
from tests.conftest import REPO, kubectl, wait_for
from tests.operator.conftest import OperatorProcess
from tests.operator.test_reconcile import hashes, spec

pytestmark = pytest.mark.cluster

LEASE_SECONDS = 15  # the operator fixture's SPYRE_OPERATOR_LEASE_SECONDS


def test_standby_takes_over_when_the_leader_dies_and_nothing_is_done_twice(operator, ns, tmp_path):
    ns.apply_model("warm", spec(replicas=1))
    ns.wait_ready("warm", 1)  # the fixture's operator leads
    standby = OperatorProcess(operator.env["KUBECONFIG"], tmp_path / "standby.log").start()
    try:
        wait_for(lambda: standby.scrape("/healthz") == "ok", what="the standby's health endpoint")
        assert standby.metric("spyre_operator_is_leader") == 0
        assert operator.metric("spyre_operator_is_leader") == 1
        time.sleep(2)
        assert standby.metric("spyre_operator_reconciles_total") == 0  # a standby never acts

        operator.kill()
        killed_at = time.monotonic()
        ns.apply_model("m", spec(replicas=2))
        ns.wait_ready("m", 2, timeout=60)
        takeover = time.monotonic() - killed_at
        assert standby.metric("spyre_operator_is_leader") == 1
        assert takeover < LEASE_SECONDS + 10, takeover
        time.sleep(3)
        assert len(ns.pods("m")) == 2
        created = [e for e in ns.events("m") if e.reason == "PodCreated"]
        assert len(created) == 2  # one creation per pod: no pass acted twice
    finally:
        operator.start()  # back as the standby
        standby.stop()  # a clean stop hands the Lease over at once
    wait_for(
        lambda: operator.metric("spyre_operator_is_leader") == 1, timeout=30, what="the fixture leads again"
    )
    ns.wait_ready("m", 2)


def test_metrics_count_reconciles_models_and_pods(operator, ns):
    ns.apply_model("m", spec(replicas=2))
    ns.wait_ready("m", 2)
    wait_for(lambda: operator.metric("spyre_operator_pods", 'state="ready"') >= 2, what="pods metric")
    assert operator.metric("spyre_operator_models", 'phase="Ready"') >= 1
    assert operator.metric("spyre_operator_reconciles_total", 'result="success"') > 0
    assert operator.metric("spyre_operator_reconcile_seconds_count") > 0
    assert "spyre_operator_workqueue_depth" in operator.scrape()


EXPECTED = {
    # resource: verbs, exactly what the code calls (plus what kopf needs to watch)
    "spyremodels.spyre-serve.io": {"get", "list", "watch"},
    "spyremodels.spyre-serve.io/status": {"update"},
    "spyremodels.spyre-serve.io/finalizers": {"update"},
    # get and patch: what the model loader's Role grants (the API server lets a role grant only what its
    # creator holds); the operator itself reads its loader's progress from the pods it lists
    "pods": {"list", "watch", "create", "delete", "get", "patch"},
    # the model loader's identity, one of each per model (loader_job.py)
    "serviceaccounts": {"create"},
    "roles.rbac.authorization.k8s.io": {"create"},
    "rolebindings.rbac.authorization.k8s.io": {"create"},
    "jobs.batch": {"list", "watch", "create", "delete"},
    "services": {"get", "list", "watch", "create", "patch"},
    "persistentvolumeclaims": {"get", "list", "watch", "create", "patch"},
    "events": {"create"},
    "resourceclaimtemplates.resource.k8s.io": {"list", "create", "delete"},
    "inferencepools.inference.networking.k8s.io": {"get", "list", "watch", "create", "patch", "delete"},
    "networkpolicies.networking.k8s.io": {"get", "list", "watch", "create", "patch", "delete"},
    # the per-model PodMonitor when prometheus-operator's API is served (kinds/pod_monitor.py)
    "podmonitors.monitoring.coreos.com": {"get", "create", "patch"},
    # the Secrets a model's pods read (spec.auth.apiKey, spec.tls), to check and digest them (kinds/access.py)
    "secrets": {"get", "list", "watch"},
    # token authorization: each such model's ServiceAccount bound to system:auth-delegator, that role only
    "clusterrolebindings.rbac.authorization.k8s.io": {"list", "watch", "create", "delete"},
    "clusterroles.rbac.authorization.k8s.io": {"bind"},
    "nodes": {"get"},
    "customresourcedefinitions.apiextensions.k8s.io": {"get", "list", "watch"},
}


def can_i(cluster, namespace: str) -> dict[str, set[str]]:
    out = kubectl(
        cluster,
        "auth",
        "can-i",
        "--list",
        "-n",
        namespace,
        "--as=system:serviceaccount:spyre-system:spyre-operator",
    ).stdout
    granted: dict[str, set[str]] = {}
    for line in out.splitlines()[1:]:
        parts = line.split()
        if not parts or parts[0].startswith(("selfsubject", "[")) or "/api" in parts[0]:
            continue
        verbs = line[line.index("[", len(parts[0])) :].rsplit("[", 1)[1].strip("] ").split()
        granted.setdefault(parts[0], set()).update(verbs)
    return granted


def test_rbac_is_exactly_what_the_code_calls(cluster, operator_rbac):
    granted = can_i(cluster, "default")
    granted.pop("selfsubjectaccessreviews.authorization.k8s.io", None)
    granted.pop("selfsubjectrulesreviews.authorization.k8s.io", None)
    assert granted == EXPECTED
    leases = can_i(cluster, "spyre-system")
    assert leases.get("leases.coordination.k8s.io") == {"get", "create", "update"}
    # namespace editors manage SpyreModels, viewers read them (aggregated into the built-in roles)
    kubectl(cluster, "apply", "-f", str(REPO / "deploy/rbac/aggregate.yaml"))
    kubectl(cluster, "create", "namespace", "team-rbac", check=False)
    for user, role in (("alice", "edit"), ("bob", "view")):
        kubectl(
            cluster,
            "create",
            "rolebinding",
            f"{user}-{role}",
            f"--clusterrole={role}",
            f"--user={user}",
            "-n",
            "team-rbac",
            check=False,
        )

    def allowed(user, verb):
        out = kubectl(
            cluster,
            "auth",
            "can-i",
            verb,
            "spyremodels.spyre-serve.io",
            "-n",
            "team-rbac",
            f"--as={user}",
            check=False,
        )
        return out.stdout.strip() == "yes"

    wait_for(lambda: allowed("alice", "create"), what="editors may create SpyreModels")
    assert allowed("bob", "list") and not allowed("bob", "create")


@pytest.fixture(params=[(3, 8), (4, 5)], ids=["spare-cards", "no-spare-card"])
def fleet_nodes(kube, request):
    """More pseudo nodes for 20 models, tainted so that no other test's pods land there: 3 x 8 cards (room
    for 4 surge pods) or 4 x 5 (none: every rollout deletes a model's old pod before its new one starts)."""
    core = client.CoreV1Api(kube)
    count, cards = request.param
    nodes = spyre_nodes(count=count, cards=cards, prefix="fleet-node")
    for node in nodes:
        node.extra_labels["spyre-serve.io/pool"] = "fleet"
    names = register_nodes(kube, nodes)
    for name in names:
        taints = core.read_node(name).spec.taints or []
        taint = {"key": "spyre-serve.io/pool", "value": "fleet", "effect": "NoSchedule"}
        core.patch_node(
            name,
            {"spec": {"taints": [core.api_client.sanitize_for_serialization(t) for t in taints] + [taint]}},
        )
    yield {
        "nodeSelector": {"spyre-serve.io/pool": "fleet"},
        "tolerations": [
            {"key": "spyre-serve.io/pool", "operator": "Equal", "value": "fleet", "effect": "NoSchedule"}
        ],
    }
    for name in names:
        core.delete_node(name)


def test_operator_settings_roll_out_across_models_a_few_at_a_time(operator, ns, fleet_nodes):
    names = [f"f{i:02d}" for i in range(20)]
    for name in names[:-1]:
        ns.apply_model(name, spec(replicas=1, **fleet_nodes))
    pinned = spec(replicas=1, image="example.org/pinned/runtime:1.0", **fleet_nodes)
    ns.apply_model(names[-1], pinned)  # pins its image
    for name in names:
        ns.wait_ready(name, 1, timeout=120)
    old = {name: hashes(ns, name)[0] for name in names}
    ns.kubelet.ready_delay = 2.0
    limit = 3
    operator.stop()  # a clean stop hands the Lease over at once
    operator.env.update(
        SPYRE_OPERATOR_RUNTIME_IMAGE="quay.io/spyre-serve/runtime:0.2.0",
        SPYRE_OPERATOR_MAX_CONCURRENT_ROLLOUTS=str(limit),
    )
    operator.start()
    most = 0
    try:

        def snapshot() -> dict[str, list[tuple[str, bool]]]:
            """(template hash, Ready) of every live pod per model, from one LIST: one instant of the
            cluster, so a model that finished is never counted beside one that started after it."""
            pods = ns.core.list_namespaced_pod(ns.name).items
            out: dict[str, list[tuple[str, bool]]] = {name: [] for name in names}
            for p in pods:
                model = (p.metadata.labels or {}).get("spyre-serve.io/model")
                if model in out and not p.metadata.deletion_timestamp:
                    ready = any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
                    out[model].append((p.metadata.labels["spyre-serve.io/template-hash"], ready))
            return out

        def rolling(now) -> int:
            return sum(
                any(h != old[name] for h, _ in pods) and not (len(pods) == 1 and pods[0][1])
                for name, pods in now.items()
            )

        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            now = snapshot()
            most = max(most, rolling(now))
            done = [n for n in names[:-1] if len(now[n]) == 1 and now[n][0][0] != old[n] and now[n][0][1]]
            if len(done) == len(names) - 1 and len(now[names[-1]]) == 1:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"not all models rolled: {len(done)} of {len(names) - 1}")
        assert 1 <= most <= limit, most
        assert hashes(ns, names[-1]) == [old[names[-1]]]  # the pinned model did not restart
        staged = [e for n in names[:-1] for e in ns.events(n) if e.reason == "StagedRollout"]
        assert staged, "models waiting for their turn say so"
    finally:
        for name in names:
            ns.custom.delete_namespaced_custom_object(
                "spyre-serve.io", "v1alpha1", ns.name, "spyremodels", name
            )
        operator.stop()
        for key in ("SPYRE_OPERATOR_RUNTIME_IMAGE", "SPYRE_OPERATOR_MAX_CONCURRENT_ROLLOUTS"):
            operator.env.pop(key, None)
        operator.start()
