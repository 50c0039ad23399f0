"""Fleet operation on the real control plane: two operator replicas with leader election (kill the leader,
the standby takes over, nothing is done twice), the operator's metrics, and RBAC that is exactly what the
code calls (`kubectl auth can-i --list` as the operator's service account)."""

from __future__ import annotations

import time

import pytest

from tests.conftest import REPO, kubectl, wait_for
from tests.operator.conftest import OperatorProcess
from tests.operator.test_reconcile import spec

pytestmark = pytest.mark.cluster

LEASE_SECONDS = 6  # the operator fixture's SPYRE_OPERATOR_LEASE_SECONDS


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
    "pods": {"list", "watch", "create", "delete"},
    "jobs.batch": {"list", "watch", "create", "delete"},
    "services": {"get", "create", "patch"},
    "persistentvolumeclaims": {"get", "create", "patch"},
    "events": {"create"},
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
