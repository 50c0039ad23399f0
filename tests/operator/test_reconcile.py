"""The operator against the real control plane (kube-apiserver, scheduler, garbage collector).
Pod readiness is reported by a status-only kubelet stand-in."""

from __future__ import annotations

import json
import time

import pytest
from kubernetes import client

from tests.conftest import kubectl, wait_for

pytestmark = pytest.mark.cluster

SHAPES_A = [{"promptLength": 64, "newTokens": 20, "batchSize": 1}]
SHAPES_B = [{"promptLength": 128, "newTokens": 32, "batchSize": 2}]


def spec(replicas=2, cards=1, shapes=SHAPES_A, **extra):
    return {
        "model": {"source": "pvc://models/tiny"},
        "cards": cards,
        "replicas": replicas,
        "backend": "inductor",
        "batching": {"mode": "static", "shapes": shapes},
        **extra,
    }


def env_of(pod):
    return {e.name: e.value for e in pod.spec.containers[0].env}


def hashes(ns, name):
    return sorted(p.metadata.labels["spyre-serve.io/template-hash"] for p in ns.pods(name))


def test_apply_creates_pods_service_claim_and_becomes_ready(operator, ns, cluster):
    ns.apply_model("m", spec(replicas=2, cards=2))
    m = ns.wait_ready("m", 2)
    pods = ns.pods("m")
    assert len(pods) == 2
    for pod in pods:
        c = pod.spec.containers[0]
        assert c.resources.requests["ibm.com/spyre_pf"] == "2" == c.resources.limits["ibm.com/spyre_pf"]
        assert c.args[c.args.index("--tensor-parallel-size") + 1] == "2"
        env = env_of(pod)
        assert env["SENDNN_INFERENCE_WARMUP_PROMPT_LENS"] == "64"
        assert env["TORCH_SENDNN_CACHE_DIR"] == "/cache/graphs"
        assert {v.name for v in pod.spec.volumes} >= {"graph-cache", "dshm", "model"}
        assert c.startup_probe.http_get.path == "/health" and c.readiness_probe.http_get.path == "/health"
        assert c.security_context.allow_privilege_escalation is False
        assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
        assert pod.metadata.owner_references[0].kind == "SpyreModel"
        assert pod.spec.node_name.startswith("spyre-node-")
    svc = ns.core.read_namespaced_service("m", ns.name)
    assert svc.spec.ports[0].port == 8000 and svc.spec.selector == {"spyre-serve.io/model": "m"}
    claim = ns.core.read_namespaced_persistent_volume_claim("m-graph-cache", ns.name)
    assert claim.spec.access_modes == ["ReadWriteMany"]
    st = m["status"]
    assert st["phase"] == "Ready" and st["serviceAddress"] == f"http://m.{ns.name}.svc:8000"
    # the Events come after the status write that made the model Ready (CI read them before, once)
    wait_for(
        lambda: {e.reason for e in ns.events("m")} >= {"PodCreated", "RolloutComplete"},
        timeout=30,
        what="the PodCreated and RolloutComplete Events",
    )
    # kopf's bookkeeping is in annotations, not in the status
    assert set(st) <= {
        "observedGeneration",
        "replicas",
        "readyReplicas",
        "phase",
        "selector",
        "serviceAddress",
        "templateHash",
        "conditions",
    }
    # printer columns and the scale subresource
    out = kubectl(cluster, "get", "spyremodels", "-n", ns.name).stdout
    assert "READY" in out and "PHASE" in out and "Ready" in out


def test_shape_change_rolls_out_new_pods_before_old_leave(operator, ns):
    ns.apply_model("m", spec(replicas=2))
    ns.wait_ready("m", 2)
    old = hashes(ns, "m")
    ns.kubelet.ready = False  # new pods will warm up for a while
    ns.patch_spec("m", {"batching": {"mode": "static", "shapes": SHAPES_B}})
    wait_for(lambda: len(ns.pods("m")) == 4, what="surge: 2 new pods beside 2 old")
    assert wait_for(lambda: ns.condition("m", "Progressing").get("status") == "True", what="Progressing")
    time.sleep(1)
    assert sum(h == old[0] for h in hashes(ns, "m")) == 2  # old ones still serve
    ns.kubelet.ready = True
    ns.wait_ready("m", 2)
    new = hashes(ns, "m")
    assert new[0] == new[1] != old[0]
    env = env_of(ns.pods("m")[0])
    assert (
        env["SENDNN_INFERENCE_WARMUP_PROMPT_LENS"] == "128"
        and env["SENDNN_INFERENCE_WARMUP_BATCH_SIZES"] == "2"
    )


def test_scarce_cards_wait_then_replace_one_by_one(operator, ns):
    # two 8-card pods fill both nodes: a rollout cannot surge
    ns.apply_model("big", spec(replicas=2, cards=8))
    ns.wait_ready("big", 2)
    ns.patch_spec("big", {"batching": {"mode": "static", "shapes": SHAPES_B}})
    waiting = wait_for(
        lambda: (
            ns.condition("big", "Progressing").get("reason") == "WaitingForCards"
            or any(e.reason == "WaitingForCards" for e in ns.events("big"))
        ),
        timeout=60,
        what="WaitingForCards",
    )
    assert waiting
    ns.wait_ready("big", 2, timeout=120)
    new = hashes(ns, "big")
    assert new[0] == new[1]
    # events are posted asynchronously: wait for both
    deletions = wait_for(
        lambda: (d := [e for e in ns.events("big") if e.reason == "PodDeleted"]) and len(d) >= 2 and d,
        what="two PodDeleted events",
    )
    assert len(deletions) == 2
    assert all("freeing cards" in e.message or "replaced" in e.message for e in deletions)


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ({"cards": 3}, "spec.cards: must be one of 1, 2, 4, 8"),
        ({"batching": {"mode": "static", "shapes": []}}, "spec.batching.shapes: static batching needs"),
        ({"batching": {"mode": "continuous", "maxNumSeqs": 4}}, "needs maxNumSeqs and maxModelLen"),
        ({"graphCache": {"existingClaim": "x", "storageClassName": "y"}}, "exclude each other"),
    ],
)
def test_invalid_spec_sets_condition_and_event_and_creates_nothing(operator, ns, bad, needle):
    body = {**spec(replicas=1), **bad}
    if "cards" in bad:  # the API server's schema (the cards enum) refuses it first: 422 naming the field
        with pytest.raises(client.ApiException) as refused:
            ns.apply_model("bad", body)
        assert refused.value.status == 422, refused.value
        assert json.loads(refused.value.body)["message"] == (
            'SpyreModel.spyre-serve.io "bad" is invalid: spec.cards: Unsupported value: 3: '
            'supported values: "1", "2", "4", "8"'
        )
        assert ns.pods("bad") == []
        return
    ns.apply_model("bad", body)  # the schema lets these through: the operator refuses them
    cond = wait_for(
        lambda: (
            ns.condition("bad", "Degraded")
            if ns.condition("bad", "Degraded").get("reason") == "InvalidSpec"
            else None
        ),
        what="InvalidSpec condition",
    )
    assert needle in cond["message"]
    assert ns.condition("bad", "Ready")["status"] == "False"
    assert wait_for(
        lambda: [e for e in ns.events("bad") if e.reason == "InvalidSpec"], what="InvalidSpec event"
    )
    assert ns.pods("bad") == []
    assert not [s for s in ns.core.list_namespaced_service(ns.name).items if s.metadata.name == "bad"]
    claims = [c.metadata.name for c in ns.core.list_namespaced_persistent_volume_claim(ns.name).items]
    assert "bad-graph-cache" not in claims


def test_delete_removes_owned_objects_and_claim_follows_retention(operator, ns):
    ns.apply_model("keep", spec(replicas=1))
    ns.apply_model("drop", spec(replicas=1, graphCache={"retention": "Delete"}))
    ns.wait_ready("keep", 1)
    ns.wait_ready("drop", 1)
    for name in ("keep", "drop"):
        ns.custom.delete_namespaced_custom_object("spyre-serve.io", "v1alpha1", ns.name, "spyremodels", name)
    wait_for(
        lambda: not ns.core.list_namespaced_pod(ns.name).items, timeout=60, what="pods garbage-collected"
    )
    wait_for(
        lambda: not ns.core.list_namespaced_service(ns.name).items, timeout=60, what="services collected"
    )

    def claims():
        return sorted(
            c.metadata.name
            for c in ns.core.list_namespaced_persistent_volume_claim(ns.name).items
            if not c.metadata.deletion_timestamp and c.metadata.name != "models"
        )

    wait_for(lambda: claims() == ["keep-graph-cache"], timeout=60, what="only the retained claim left")


def test_pod_deleted_by_hand_is_recreated(operator, ns):
    ns.apply_model("m", spec(replicas=2))
    ns.wait_ready("m", 2)
    victim = ns.pods("m")[0].metadata.name
    ns.core.delete_namespaced_pod(victim, ns.name)
    wait_for(
        lambda: victim not in [p.metadata.name for p in ns.pods("m")] and len(ns.pods("m")) == 2,
        what="a replacement pod",
    )
    ns.wait_ready("m", 2)


def test_scale_and_suspend(operator, ns, cluster):
    ns.apply_model("m", spec(replicas=1))
    ns.wait_ready("m", 1)
    kubectl(cluster, "scale", "-n", ns.name, "spyremodel/m", "--replicas=3")
    ns.wait_ready("m", 3)
    ns.patch_spec("m", {"suspend": True})
    wait_for(
        lambda: not ns.pods("m") and ns.model("m")["status"].get("phase") == "Suspended", what="suspended"
    )
    assert ns.core.read_namespaced_persistent_volume_claim("m-graph-cache", ns.name)
    ns.patch_spec("m", {"suspend": False})
    ns.wait_ready("m", 3)


def test_idle_resync_makes_no_write(operator, ns):
    ns.apply_model("m", spec(replicas=1))
    ns.wait_ready("m", 1)
    time.sleep(4)  # let the last writes settle
    before = ns.model("m")["metadata"]["resourceVersion"]
    pod_versions = [p.metadata.resource_version for p in ns.pods("m")]
    time.sleep(10)  # three resync periods of 3 s
    assert ns.model("m")["metadata"]["resourceVersion"] == before
    assert [p.metadata.resource_version for p in ns.pods("m")] == pod_versions


def test_crash_loop_reports_degraded(operator, ns):
    ns.apply_model("m", spec(replicas=1))
    ns.wait_ready("m", 1)
    ns.kubelet.crashing.add(ns.pods("m")[0].metadata.name)
    cond = wait_for(
        lambda: (
            ns.condition("m", "Degraded") if ns.condition("m", "Degraded").get("status") == "True" else None
        ),
        what="Degraded",
    )
    assert cond["reason"] == "CrashLoop" and "exit" in cond["message"]


def test_operator_killed_mid_rollout_converges_without_duplicates(operator, ns):
    ns.apply_model("m", spec(replicas=2))
    ns.wait_ready("m", 2)
    ns.kubelet.ready = False
    ns.patch_spec("m", {"batching": {"mode": "static", "shapes": SHAPES_B}})
    wait_for(lambda: len(ns.pods("m")) == 4, what="rollout under way")
    operator.kill()
    ns.kubelet.ready = True
    operator.start()
    ns.wait_ready("m", 2, timeout=90)
    time.sleep(4)
    pods = ns.pods("m")
    assert len(pods) == 2 and len(set(hashes(ns, "m"))) == 1
