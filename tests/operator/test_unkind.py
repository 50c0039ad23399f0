"""The operator in an unkind cluster (the real control plane with OwnerReferencesPermissionEnforcement and
ResourceQuota admission; pods that warm up slowly, crash with last words, get evicted, never pull): every
failure ends in a condition and an Event, failed pods are replaced, rollouts keep the availability budget."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid

import pytest
from kubernetes import client
from spyre_operator.admission import check_spec
from spyre_operator.io.events import EventRecorder
from spyre_operator.io.kube import Kube
from spyre_operator.io.watch import WatchCache
from spyre_operator.io.work import Pass
from spyre_operator.kinds.pods.plan import PodPlan
from spyre_operator.kinds.pods.step import PodStep
from spyre_operator.kinds.pods.template import build_pod
from spyre_operator.settings import GROUP, KIND, VERSION, load_settings

from tests.conftest import wait_for
from tests.operator.catalog import CATALOG
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
    """The catalog's table on a cluster that ignores CEL (1.20): the rows a plain schema keyword refuses are
    refused when they are applied; every other row is accepted and reaches the operator, which refuses it."""
    applied = {}
    for row in CATALOG:
        try:
            ns.apply_model(row.model_name, row.spec)
        except client.ApiException as e:
            assert row.refused_by_legacy_server, (row.id, e.status, e.body)
            message = json.loads(e.body)["message"]
            assert e.status == 422 and row.refused_by_legacy_server in message, (row.id, message)
            continue
        assert not row.refused_by_legacy_server, f"{row.id}: the 1.20 server should have refused it"
        applied[row.model_name] = (row.id, row.needle)
    assert len(applied) == sum(not r.refused_by_legacy_server for r in CATALOG) >= 35

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


def not_compiling(ns, name) -> dict:
    """The Progressing condition of a model whose pods have not started: it never says they compile."""
    cond = ns.condition(name, "Progressing")
    assert cond.get("reason") != "Warming" and "compiling" not in cond.get("message", ""), cond
    return cond


def test_image_the_kubelet_cannot_pull_is_err_image_pull(operator, ns):
    image = "example.org/spyre/runtime:missing"
    ns.kubelet.unpullable.add(image)
    ns.apply_model("m", spec(replicas=1, image=image))
    cond = wait_for(
        lambda: (c := ns.condition("m", "Stalled")).get("reason") == "ErrImagePull" and c, what="Stalled"
    )
    assert f'failed to pull and unpack image "{image}"' in cond["message"]
    assert ns.condition("m", "Ready")["reason"] == "ErrImagePull"
    not_compiling(ns, "m")
    assert wait_for(lambda: [e for e in ns.events("m") if e.reason == "ErrImagePull"], what="an Event")


def test_missing_secret_key_is_create_container_config_error_until_the_secret_exists(operator, ns):
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    ns.apply_model("m", spec(replicas=1, env=[token]))
    cond = wait_for(
        lambda: (c := ns.condition("m", "Stalled")).get("reason") == "CreateContainerConfigError" and c,
        what="Stalled CreateContainerConfigError",
    )
    assert 'secret "hf" not found' in cond["message"]  # the kubelet's own words
    assert ns.condition("m", "Ready")["reason"] == "CreateContainerConfigError"
    not_compiling(ns, "m")
    ns.core.create_namespaced_secret(ns.name, {"metadata": {"name": "hf"}, "stringData": {"other": "x"}})
    cond = wait_for(
        lambda: "couldn't find key token" in (c := ns.condition("m", "Stalled")).get("message", "") and c,
        what="the missing key named",
    )
    assert cond["reason"] == "CreateContainerConfigError"
    ns.core.patch_namespaced_secret("hf", ns.name, {"stringData": {"token": "t"}})
    ns.wait_ready("m", 1, timeout=60)
    assert ns.condition("m", "Stalled")["status"] == "False"


def test_missing_graph_cache_claim_is_waiting_for_claim(operator, ns):
    ns.apply_model("m", spec(replicas=1, graphCache={"existingClaim": "no-such-cache"}))
    cond = wait_for(
        lambda: (c := ns.condition("m", "Progressing")).get("reason") == "WaitingForClaim" and c,
        what="Progressing WaitingForClaim",
    )
    assert 'persistentvolumeclaim "no-such-cache" not found' in cond["message"]  # the scheduler's words
    assert ns.condition("m", "Ready")["reason"] == "WaitingForClaim"
    assert ns.condition("m", "Reconciling")["status"] == "True"
    assert wait_for(lambda: [e for e in ns.events("m") if e.reason == "WaitingForClaim"], what="an Event")
    ns.core.create_namespaced_persistent_volume_claim(
        ns.name,
        {
            "metadata": {"name": "no-such-cache"},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
        },
    )
    ns.wait_ready("m", 1, timeout=120)


def test_pod_bound_to_a_node_that_never_starts_it_is_reported_with_node_and_wait(operator, ns):
    ns.kubelet.stopped_nodes.update({"spyre-node-0", "spyre-node-1"})
    ns.apply_model("m", spec(replicas=1))
    pod = wait_for(lambda: [p for p in ns.pods("m") if p.spec.node_name], what="the pod bound")[0]
    cond = wait_for(
        lambda: (c := ns.condition("m", "Progressing")).get("reason") == "NotStarted" and c,
        timeout=40,
        what="Progressing NotStarted",
    )
    assert (
        f"pod {pod.metadata.name} is bound to node {pod.spec.node_name} and has not started after"
        in (cond["message"])
    )
    assert int(cond["message"].split("after ")[1].split(" s")[0]) >= 5  # the grace period passed
    assert ns.condition("m", "Ready")["reason"] == "NotStarted"
    not_compiling(ns, "m")
    ns.kubelet.stopped_nodes.clear()
    ns.wait_ready("m", 1)


def test_devices_on_a_cluster_without_dra_say_so(operator, ns):
    ns.apply_model("m", spec(replicas=1, cards=2, devices={}))
    cond = wait_for(
        lambda: (c := ns.condition("m", "Stalled")).get("reason") == "DRAUnavailable" and c,
        what="Stalled DRAUnavailable",
    )
    assert cond["message"].startswith("spec.devices: asks for cards by Dynamic Resource Allocation")
    assert "resource.k8s.io/v1" in cond["message"]
    assert wait_for(lambda: [e for e in ns.events("m") if e.reason == "DRAUnavailable"], what="an Event")
    assert ns.pods("m") == []
    # the same model by extended resource is served
    ns.patch_spec("m", {"devices": None})  # a merge patch's null removes the field
    ns.wait_ready("m", 1)


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


def quota_used(ns) -> str | None:
    used = ns.core.read_namespaced_resource_quota("cards", ns.name).status.used or {}
    return used.get("requests.ibm.com/spyre_pf")


def test_rollout_under_a_card_quota_moves_one_pod_at_a_time(operator, ns):
    ns.core.create_namespaced_resource_quota(
        ns.name,
        {"metadata": {"name": "cards"}, "spec": {"hard": {"requests.ibm.com/spyre_pf": "2"}}},
    )
    # The quota controller's first count of a new quota can land after admission charged the first pods, and
    # overwrites their charge with 0 until its next count (minutes later): the rollout's surge pod would then
    # be admitted. So the pods come once the quota has been counted, and the test checks they were charged.
    wait_for(lambda: quota_used(ns) == "0", what="the quota's first count")
    ns.apply_model("q", spec(replicas=2))
    ns.wait_ready("q", 2)
    wait_for(lambda: quota_used(ns) == "2", what="the quota to charge the two pods' cards")
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


def test_a_pod_the_quota_refuses_is_a_warning_event_from_the_step_itself(ns):
    """The pass that meets the quota may lose its status write (and the Degraded Event with it) to a write
    conflict, and the next pass deletes an old pod first and meets no refusal: the pod step itself says it.
    The step runs here in-process on the real control plane, for a model the operator never saw (no status
    is written at all); the words come once however often the same refusal recurs."""
    ns.core.create_namespaced_resource_quota(
        ns.name, {"metadata": {"name": "cards"}, "spec": {"hard": {"requests.ibm.com/spyre_pf": "0"}}}
    )
    wait_for(
        lambda: ns.core.read_namespaced_resource_quota("cards", ns.name).status.hard or {},
        what="the quota's status",
    )
    settings = load_settings({})
    model = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": "unseen", "namespace": ns.name, "uid": str(uuid.uuid4()), "generation": 1},
        "spec": spec(replicas=1),
    }
    model_spec = check_spec("unseen", model["spec"], settings)
    kube = Kube(ns.kube, settings.api_timeout_seconds)
    step = PodStep(settings, kube, EventRecorder(kube.core, settings.api_timeout_seconds), WatchCache())
    for _ in range(2):
        work = Pass()
        step._apply(
            (ns.name, "unseen"),
            model,
            PodPlan(create=1),
            lambda: build_pod(model, model_spec, settings),
            work,
        )
        assert [p.reason for p in work.problems] == ["QuotaExceeded"]
    events = wait_for(lambda: ns.events("unseen"), timeout=10, what="the step's Event")
    assert [(e.type, e.reason) for e in events] == [("Warning", "QuotaExceeded")], [e.message for e in events]
    assert "exceeded quota: cards" in events[0].message and events[0].message == work.problems[0].message
    assert not ns.core.list_namespaced_pod(ns.name).items


def test_an_event_the_api_server_refused_is_posted_when_the_same_words_come_again(kube):
    """Words are posted once, but only once they were taken: a refused post (here: its namespace does not
    exist yet) leaves them free to be posted by a later pass."""
    core = client.CoreV1Api(kube)
    name = f"events-{uuid.uuid4().hex[:8]}"
    model = {"metadata": {"name": "m", "namespace": name, "uid": str(uuid.uuid4())}}
    recorder = EventRecorder(core, 5.0)
    recorder.post(model, "Warning", "QuotaExceeded", "Pod refused: exceeded quota: cards")
    core.create_namespace({"metadata": {"name": name}})
    try:
        for _ in range(2):
            recorder.post(model, "Warning", "QuotaExceeded", "Pod refused: exceeded quota: cards")
        events = core.list_namespaced_event(name).items
        assert [(e.reason, e.message) for e in events] == [
            ("QuotaExceeded", "Pod refused: exceeded quota: cards")
        ]
    finally:
        core.delete_namespace(name)


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
