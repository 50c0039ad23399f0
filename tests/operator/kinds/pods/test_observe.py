"""What is read off a pod: failures, the kubelet's reasons, the runtime's last words."""

from __future__ import annotations

from spyre_operator.kinds.pods.observe import observe_pod
from spyre_operator.settings import HASH_LABEL

from tests.operator.objects import NOW, cond, pod, pod_dict, status_for


def test_a_pod_the_kubelet_will_not_start_is_named_by_the_kubelets_reason():
    """What both kubelet stand-ins write for a pod they refuse to start (tests/cluster/kubelet_checks.py),
    read by the operator: the kubelet's reason and message, Stalled, and never said to compile. (The
    operator refuses an image reference that does not parse before any pod exists; a pod made before an
    upgrade of the operator may still carry one.)"""
    from kubernetes import client

    from tests.cluster.kubelet_checks import start_blocker, waiting_status

    containers = [client.V1Container(name="runtime", image="quay.io/Spyre/runtime:1")]
    refused = client.V1Pod(
        metadata=client.V1ObjectMeta(name="b", namespace="ml"),
        spec=client.V1PodSpec(containers=containers, node_name="spyre-node-0"),
    )
    blocked = start_blocker(None, refused, unpullable=set())  # the image is checked before any API call
    assert blocked[:2] == ("runtime", "InvalidImageName")
    for reason, message in (blocked[1:], ("CreateContainerConfigError", 'secret "hf" not found')):
        body = {
            "metadata": {"name": "b", "labels": {HASH_LABEL: "h1"}, "creationTimestamp": "t"},
            "spec": {"nodeName": "spyre-node-0"},
            **waiting_status(refused, "runtime", reason, message, "2026-11-25T12:00:00Z"),
        }
        status = status_for([pod_dict("a", ready=True), body])
        assert cond(status, "Stalled")["reason"] == reason == cond(status, "Ready")["reason"]
        assert cond(status, "Stalled")["message"].endswith(message)
        assert cond(status, "Progressing")["reason"] in ("Starting", "NotStarted")


def test_observe_pod_reads_failures_and_last_words():
    crash = pod(
        "c", ready=False, waiting="CrashLoopBackOff", last_message="starting\nConfigError: bad shape\n"
    )
    view, health = observe_pod(crash, "ibm.com/spyre_pf", HASH_LABEL, now=NOW)
    assert health.failure_reason == "CrashLoop" and health.failure_message.endswith(
        ": ConfigError: bad shape"
    )
    assert not view.is_dead
    evicted, health = observe_pod(pod("e", phase="Failed"), "ibm.com/spyre_pf", HASH_LABEL, now=NOW)
    assert evicted.is_dead and "Evicted" in evicted.dead_reason and not evicted.is_ready
    young = pod("p", ready=False, waiting="ImagePullBackOff")
    assert not observe_pod(young, "x/y", HASH_LABEL, now=NOW, stuck_grace_seconds=120)[0].is_dead
    old = observe_pod(young, "x/y", HASH_LABEL, now=NOW, stuck_grace_seconds=30)
    assert old[0].is_dead and old[1].failure_reason == "ImagePullBackOff"


def test_a_warm_pod_that_fails_its_readiness_probe_is_not_ready_not_warming():
    """As the kubelet reports it (seen on the real node, tests/test_real_node.py): the container passed its
    startup probe (`started`), then its readiness probe fails, so Ready turned False after the container
    started. Degraded and not Stalled (the kubelet's liveness probe may still heal it), with an Event. A pod
    between its startup probe and its first readiness probe (Ready False since before it started) is not."""

    def warm(since: str) -> dict:
        body = pod_dict("w", node="n1")
        body["status"]["conditions"][0]["lastTransitionTime"] = since
        body["status"]["containerStatuses"] = [
            {
                "name": "runtime",
                "ready": False,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": "2026-11-25T12:00:00Z"}},
            }
        ]
        return body

    status = status_for([pod_dict("a", ready=True), warm("2026-11-25T12:05:00Z")])
    assert cond(status, "Ready")["reason"] == "NotReady" == cond(status, "Degraded")["reason"]
    message = cond(status, "Degraded")["message"]
    assert message.startswith("pod w: container runtime passed its startup probe but fails its readiness")
    assert cond(status, "Stalled")["status"] == "False" and cond(status, "Reconciling")["status"] == "True"
    fresh = status_for([pod_dict("a", ready=True), warm("2026-11-25T11:59:58Z")])
    assert cond(fresh, "Degraded")["status"] == "False" and cond(fresh, "Ready")["reason"] == "Warming"
    terminating = warm("2026-11-25T12:05:00Z")
    terminating["metadata"]["deletionTimestamp"] = "2026-11-25T12:05:01Z"
    assert observe_pod(terminating, "x/y", HASH_LABEL, now=NOW)[1].failure_reason is None
