"""The operator in an unkind cluster (the real control plane with OwnerReferencesPermissionEnforcement and
ResourceQuota admission; pods that warm up slowly, crash with last words, get evicted, never pull): every
failure ends in a condition and an Event, failed pods are replaced, rollouts keep the availability budget."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.operator.catalog import BASE, CATALOG
from tests.operator.test_reconcile import SHAPES_B, hashes, spec

pytestmark = pytest.mark.cluster


def ready_pods(ns, name) -> int:
    return sum(
        any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        for p in ns.pods(name)
    )


@contextlib.contextmanager
def sampled(measure, period: float = 0.2):
    """Samples `measure()` in a thread while the block runs; yields the list of samples."""
    samples: list = []
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            with contextlib.suppress(Exception):
                samples.append(measure())
            time.sleep(period)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def test_hostile_catalog_each_gets_a_condition_and_no_pod(operator, ns):
    applied = {}
    for row_id, name, changes, needle, _ in CATALOG:
        name = row_id if name == "m" else name
        try:
            ns.apply_model(name, {**BASE, **changes})
        except client.ApiException as e:  # the API server's schema caught it first: clear, nothing made
            assert e.status in (400, 422), (row_id, e.status)
            continue
        applied[name] = (row_id, needle)
    assert len(applied) >= 20  # most reach the operator (the schema catches a few)

    def refused(name):
        c = ns.condition(name, "Stalled")
        return c.get("status") == "True" and c.get("reason") == "InvalidSpec" and c

    for name, (row_id, needle) in applied.items():
        cond = wait_for(lambda n=name: refused(n), timeout=30, what=f"InvalidSpec for {row_id}")
        assert needle in cond["message"], (row_id, cond["message"])
        assert ns.condition(name, "Ready")["status"] == "False"
        assert len(name) > 63 or ns.pods(name) == [], row_id  # (no label value holds a longer name)
    events = wait_for(
        lambda: (
            {
                e.involved_object.name
                for e in ns.core.list_namespaced_event(ns.name).items
                if e.reason == "InvalidSpec"
            }
            >= set(applied)
        ),
        what="an InvalidSpec event per model",
    )
    assert events
    # one Event per distinct error, not per retry
    time.sleep(4)
    per_model = {}
    for e in ns.core.list_namespaced_event(ns.name).items:
        if e.reason == "InvalidSpec":
            per_model[e.involved_object.name] = per_model.get(e.involved_object.name, 0) + 1
    assert max(per_model.values()) == 1
    # the operator still serves the others
    ns.apply_model("fine", spec(replicas=1))
    ns.wait_ready("fine", 1)


def test_evicted_pod_is_replaced(operator, ns):
    ns.apply_model("m", spec(replicas=2))
    ns.wait_ready("m", 2)
    victim = ns.pods("m")[0].metadata.name
    ns.kubelet.evict(victim)
    wait_for(lambda: victim not in [p.metadata.name for p in ns.pods("m")], what="evicted pod removed")
    ns.wait_ready("m", 2)
    replaced = wait_for(
        lambda: [e for e in ns.events("m") if e.reason == "PodReplaced" and victim in e.message], what="event"
    )
    assert "Evicted" in replaced[0].message


def test_crash_loop_quotes_the_runtime_last_line(operator, ns):
    ns.apply_model("m", spec(replicas=1))
    ns.wait_ready("m", 1)
    pod = ns.pods("m")[0].metadata.name
    ns.kubelet.messages[pod] = (
        "loading\nspyre-runtime: error: SENDNN_INFERENCE_WARMUP_PROMPT_LENS: 100 is bad\n"
    )
    ns.kubelet.crashing.add(pod)
    cond = wait_for(
        lambda: (c := ns.condition("m", "Stalled")).get("reason") == "CrashLoop" and c,
        what="Stalled CrashLoop",
    )
    assert cond["message"].endswith("spyre-runtime: error: SENDNN_INFERENCE_WARMUP_PROMPT_LENS: 100 is bad")
    assert ns.condition("m", "Ready")["status"] == "False"


def test_image_that_never_pulls_is_named_and_replaced_after_grace(operator, ns):
    ns.kubelet.bad_images.add("registry.invalid/runtime:nope")
    ns.apply_model("m", spec(replicas=1, image="registry.invalid/runtime:nope"))
    cond = wait_for(
        lambda: (c := ns.condition("m", "Stalled")).get("reason") == "ImagePullBackOff" and c, what="Stalled"
    )
    assert "registry.invalid/runtime:nope" in cond["message"]
    first = ns.pods("m")[0].metadata.name
    wait_for(
        lambda: [e for e in ns.events("m") if e.reason == "PodReplaced" and first in e.message],
        timeout=40,
        what="the stuck pod replaced after the grace period",
    )
    # the image fixed: the model recovers
    ns.kubelet.bad_images.clear()
    ns.patch_spec("m", {"image": "quay.io/spyre-serve/runtime:0.1.0"})
    ns.wait_ready("m", 1)
    assert ns.condition("m", "Stalled")["status"] == "False"


def test_scarce_card_rollout_never_below_one_ready_pod(operator, ns):
    ns.apply_model("big", spec(replicas=2, cards=8))
    ns.wait_ready("big", 2)
    old = set(hashes(ns, "big"))
    ns.kubelet.ready_delay = 8.0
    with sampled(lambda: ready_pods(ns, "big")) as seen:
        ns.patch_spec("big", {"batching": {"mode": "static", "shapes": SHAPES_B}})
        wait_for(
            lambda: set(hashes(ns, "big")).isdisjoint(old) and ready_pods(ns, "big") == 2,
            timeout=120,
            what="rolled",
        )
        ns.wait_ready("big", 2, timeout=30)
    assert min(seen) >= 1


def test_rollout_under_a_card_quota_moves_one_pod_at_a_time(operator, ns):
    ns.core.create_namespaced_resource_quota(
        ns.name,
        {"metadata": {"name": "cards"}, "spec": {"hard": {"requests.ibm.com/spyre_pf": "2"}}},
    )
    ns.apply_model("q", spec(replicas=2))
    ns.wait_ready("q", 2)
    old = set(hashes(ns, "q"))
    with sampled(lambda: len(ns.pods("q"))) as seen:
        ns.patch_spec("q", {"batching": {"mode": "static", "shapes": SHAPES_B}})
        wait_for(
            lambda: any(e.reason == "QuotaExceeded" for e in ns.events("q")),
            timeout=30,
            what="QuotaExceeded event",
        )
        wait_for(lambda: set(hashes(ns, "q")).isdisjoint(old), timeout=120, what="rolled under the quota")
        ns.wait_ready("q", 2, timeout=60)
    assert max(seen) <= 2


def test_owned_service_is_repaired_and_a_foreign_one_is_reported(operator, ns):
    ns.core.create_namespaced_service(
        ns.name, {"metadata": {"name": "taken"}, "spec": {"ports": [{"port": 80}], "selector": {"app": "x"}}}
    )
    ns.apply_model("taken", spec(replicas=1))
    cond = wait_for(
        lambda: (c := ns.condition("taken", "Stalled")).get("reason") == "ServiceConflict" and c,
        what="conflict",
    )
    assert "not owned" in cond["message"]
    wait_for(lambda: len(ns.pods("taken")) == 1, what="pods made even without their Service")
    assert ns.core.read_namespaced_service("taken", ns.name).spec.selector == {"app": "x"}  # not adopted

    ns.apply_model("m", spec(replicas=1))
    ns.wait_ready("m", 1)
    ns.core.patch_namespaced_service("m", ns.name, {"spec": {"selector": {"spyre-serve.io/model": "other"}}})
    wait_for(
        lambda: ns.core.read_namespaced_service("m", ns.name).spec.selector == {"spyre-serve.io/model": "m"},
        what="selector restored",
    )


def test_status_is_replaced_so_stale_keys_vanish(operator, ns):
    ns.apply_model("m", spec(replicas=1, graphCache={"precompile": True}))
    wait_for(lambda: ns.model("m").get("status", {}).get("cacheKey"), what="cacheKey")
    ns.wait_ready("m", 1)
    ns.patch_spec("m", {"graphCache": {"precompile": False}})
    wait_for(lambda: "cacheKey" not in ns.model("m")["status"], what="cacheKey gone")
    conds = {c["type"] for c in ns.model("m")["status"]["conditions"]}
    assert "CacheReady" not in conds and {"Ready", "Reconciling", "Stalled"} <= conds
    ns.wait_ready("m", 1)


def test_node_going_not_ready_turns_the_model_not_ready_until_it_returns(operator, ns):
    ns.apply_model("m", spec(replicas=1))
    ns.wait_ready("m", 1)
    node = ns.pods("m")[0].spec.node_name
    ns.kubelet.set_node_ready(node, False)
    try:
        cond = wait_for(
            lambda: (c := ns.condition("m", "Ready")).get("status") == "False" and c, what="Ready=False"
        )
        assert "0/1 replicas ready" in cond["message"]
        assert ns.condition("m", "Reconciling")["status"] == "True"
    finally:
        ns.kubelet.set_node_ready(node, True)
    ns.wait_ready("m", 1)
