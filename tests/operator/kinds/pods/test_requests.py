"""What the pod step asks the API server (issue 37: at 1,000 models, a LIST of pods per model beside the pod
watch). On a control plane of its own whose API server keeps an audit log of the operator's requests: a model
made, scaled up, a pod of it deleted by someone and replaced, scaled down, and then left alone. The operator
lists none of the model's pods (it acts on its watch's view), gets no InferencePool (the watch cache knows the
model has none), and a steady pass asks the API server nothing at all."""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from tests.cluster.audit import audit_args, audit_counts
from tests.cluster.controlplane import ControlPlane, spyre_nodes
from tests.cluster.fakekubelet import FakeKubelet
from tests.conftest import REPO, ensure_k8s_binaries, kubectl, wait_for
from tests.operator.conftest import (
    GROUP,
    PLURAL,
    VERSION,
    Namespace,
    OperatorProcess,
    service_account_kubeconfig,
)

pytestmark = pytest.mark.cluster

NS = "requests"
SPEC = {
    "model": {"source": "pvc://models/tiny"},
    "backend": "eager",
    "batching": {"mode": "static", "shapes": [{"promptLength": 64, "newTokens": 4, "batchSize": 1}]},
    "graphCache": {"enabled": False},
}


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """A control plane of its own (audit log on), the operator running as its service account, and a
    namespace with the models' claim and a kubelet stand-in."""
    ensure_k8s_binaries()
    work = tmp_path_factory.mktemp("requests")
    cp = ControlPlane(workdir=work / "cluster", extra_apiserver_args=audit_args(work))
    cp.start()
    op = None
    try:
        kube = cp.api_client()
        cp.register_nodes(spyre_nodes(count=1, cards=8))
        kubectl(cp, "apply", "--validate=false", "-f", str(REPO / "crds/spyremodels.yaml"))
        kubectl(cp, "wait", "--for=condition=established", "crd/spyremodels.spyre-serve.io")
        kubectl(cp, "create", "namespace", "spyre-system")
        kubectl(cp, "apply", "-f", str(REPO / "deploy/rbac/clusterrole.yaml"))
        kubectl(cp, "create", "namespace", NS)
        claim = {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}
        client.CoreV1Api(kube).create_namespaced_persistent_volume_claim(
            NS, {"metadata": {"name": "models"}, "spec": claim}
        )
        kubeconfig = service_account_kubeconfig(cp, kube, "spyre-system", "spyre-operator", work / "kc")
        op = OperatorProcess(kubeconfig, work / "operator.log").start()
        with FakeKubelet(kube, NS, period=0.5) as kubelet:
            yield Namespace(NS, kube, kubelet), op, work / "audit.log"
    finally:
        if op is not None:
            op.stop()
        cp.stop()


def reconciles(op: OperatorProcess) -> float:
    return op.metric("spyre_operator_reconciles_total")


def test_the_pod_step_lists_no_pods_and_a_steady_pass_asks_nothing(audited):
    ns, op, audit = audited
    started = time.time()
    ns.apply_model("m", {**SPEC, "replicas": 2})
    ns.wait_ready("m", 2)
    ns.patch_spec("m", {"replicas": 3})
    ns.wait_ready("m", 3)
    gone = ns.pods("m")[0].metadata.name
    ns.core.delete_namespaced_pod(gone, NS)  # by someone: the operator replaces it
    wait_for(
        lambda: gone not in {p.metadata.name for p in ns.pods("m")} and len(ns.pods("m")) == 3,
        what=f"{gone} replaced",
    )
    ns.wait_ready("m", 3)
    ns.patch_spec("m", {"replicas": 1})
    ns.wait_ready("m", 1)
    events = [e.reason for e in ns.events("m")]
    assert events.count("PodCreated") == 4 and events.count("PodDeleted") == 2, events  # each write once

    counts = audit_counts(audit, since=started, namespace=NS)
    assert counts[("create", "pods", "")] >= 4, counts  # the log holds the operator's requests
    assert counts[("list", "pods", "")] == 0, counts  # it acted on its watch's view of the pods
    assert counts[("get", "inferencepools", "")] == 0, counts  # the model wants none, and has none
    assert counts[("get", "networkpolicies", "")] == 0, counts  # the setting is off, and the watch saw none

    # steady: resync passes (every 3 s here) over the model with nothing to change ask the API server nothing
    wait_for(lambda: not op.metric("spyre_operator_workqueue_depth"), what="the work queue drained")
    quiet, passes = time.time(), reconciles(op)
    wait_for(lambda: reconciles(op) >= passes + 2, timeout=20, what="two more passes over the model")
    asked = audit_counts(audit, since=quiet)
    asked = {k: n for k, n in asked.items() if k[1] != "leases"}  # the leader's Lease is no reconcile's
    assert asked == {}, asked
    assert ns.model("m")["status"]["readyReplicas"] == 1
    ns.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "m")
