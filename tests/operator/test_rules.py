"""Pure tests of round 2's operator rules: the hostile-spec catalog (operator rows), the rollout budget,
healing, kstatus conditions, the work queue."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
from spyre_operator.admission import check_spec
from spyre_operator.io.work import Problem
from spyre_operator.io.workqueue import Result, WorkQueue
from spyre_operator.kinds.pods.observe import observe_pod
from spyre_operator.kinds.pods.plan import Budget, PodView, plan_pods
from spyre_operator.kinds.pods.template import clone_pod
from spyre_operator.settings import HASH_LABEL, OperatorSettings
from spyre_operator.spec.model_spec import InvalidSpec, Rollout
from spyre_operator.spec.parse import parse_spec
from spyre_operator.spec.runtime_contract import check_runtime_contract
from spyre_operator.status.conditions import compute_status

from tests.conftest import REPO
from tests.operator.catalog import BASE, CATALOG


@pytest.mark.parametrize("row", [r for r in CATALOG if r.by == "operator"], ids=lambda r: r.id)
def test_catalog_refused_by_the_operator_with_a_message_naming_the_problem(row):
    """Every row the operator refuses on its own (on clusters that ignore CEL), schema rows included: a
    spec written before a CRD upgrade may predate its schema."""
    with pytest.raises(InvalidSpec) as err:
        check_spec(row.name, row.spec, OperatorSettings())
    assert row.needle in str(err.value)


def test_catalog_has_enough_rows_and_valid_base():
    assert len(CATALOG) >= 40 and len({r.id for r in CATALOG}) == len(CATALOG)
    check_runtime_contract(check_spec("m", BASE, OperatorSettings()))
    # a current cluster refuses most rows at create time; the operator, every row the 1.20 server accepts
    assert sum(bool(r.at_create) for r in CATALOG) >= 35
    assert all(r.at_create for r in CATALOG if r.schema)


def V(name, h="new", ready=False, term=False, cards=False, dead="", node="n1"):
    return PodView(name, h, ready, term, cards, f"2026-01-01T00:00:0{name[-1]}Z", node, dead)


@pytest.mark.parametrize(
    ("case", "replicas", "pods", "kw", "create", "delete", "waiting"),
    [
        # the bug of round 1: one replacement is still warming, the other lacks cards; the last old pod stays
        (
            "scarce-2-replicas-waits-for-ready",
            2,
            [V("o2", "old", True), V("n1"), V("n2", cards=True)],
            {},
            0,
            (),
            "availability budget of 1",
        ),
        (
            "scarce-2-replicas-then-frees-the-last",
            2,
            [V("o2", "old", True), V("n1", ready=True), V("n2", cards=True)],
            {},
            0,
            ("o2",),
            "",
        ),
        (
            "scarce-1-replica-is-replaced-in-place",
            1,
            [V("o1", "old", True), V("n1", cards=True)],
            {},
            0,
            ("o1",),
            "unavailable until",
        ),
        (
            "max-unavailable-0-never-frees",
            2,
            [V("o1", "old", True), V("o2", "old", True), V("n1", cards=True), V("n2", cards=True)],
            {"budget": Budget(2, 0)},
            0,
            (),
            "availability budget of 2",
        ),
        (
            "old-pod-on-a-node-that-cannot-host",
            2,
            [V("o1", "old", True), V("o2", "old", True), V("n1", cards=True), V("n2", cards=True)],
            {"can_host": frozenset({"o2"})},
            0,
            ("o2",),
            "",
        ),
        (
            "no-old-pod-can-host",
            2,
            [V("o1", "old", True), V("o2", "old", True), V("n1", cards=True), V("n2", cards=True)],
            {"can_host": frozenset()},
            0,
            (),
            "no old pod runs on a node",
        ),
        (
            "quota-blocked-acts-like-no-cards",
            2,
            [V("o1", "old", True), V("o2", "old", True)],
            {"quota_blocked": True, "budget": Budget(0, 1)},
            0,
            ("o1",),
            "",
        ),
        (
            "surge-1-creates-one-at-a-time",
            2,
            [V("o1", "old", True), V("o2", "old", True)],
            {"budget": Budget(1, 1)},
            1,
            (),
            "",
        ),
        (
            "evicted-pod-is-replaced",
            2,
            [V("a", ready=True), V("b", dead="pod ended (Failed): Evicted")],
            {},
            1,
            ("b",),
            "",
        ),
        (
            "stuck-pod-is-replaced",
            1,
            [V("a", dead="stuck in ImagePullBackOff for more than 120 s")],
            {},
            1,
            ("a",),
            "",
        ),
    ],
)
def test_rollout_budget_table(case, replicas, pods, kw, create, delete, waiting):
    plan = plan_pods(replicas, "new", pods, **kw)
    assert (plan.create, sorted(plan.delete)) == (create, sorted(delete)), case
    assert waiting in plan.waiting and (waiting or not plan.waiting or "unavailable" in plan.waiting)


@pytest.mark.parametrize(
    ("surge", "unavailable", "replicas", "expected"),
    [
        ("100%", 1, 4, (4, 1)),
        ("25%", "25%", 4, (1, 1)),
        ("25%", "25%", 3, (1, 0)),
        (0, 0, 2, (0, 1)),
        (1, "50%", 1, (1, 0)),
    ],
)
def test_rollout_resolves_like_a_deployment(surge, unavailable, replicas, expected):
    assert Rollout(surge, unavailable).resolve(replicas) == expected


NOW = datetime.datetime(2026, 11, 23, 12, 0, 0, tzinfo=datetime.UTC)


def pod(
    name, *, phase="Running", ready=True, waiting=None, last_message=None, created="2026-11-23T11:59:00Z"
):
    cs = {"name": "runtime", "image": "img:1", "restartCount": 3}
    if waiting:
        cs["state"] = {"waiting": {"reason": waiting, "message": "back-off"}}
    if last_message is not None:
        cs["lastState"] = {"terminated": {"reason": "Error", "exitCode": 2, "message": last_message}}
    status = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [cs],
    }
    if phase == "Failed":
        status.update(reason="Evicted", message="The node was low on resource: memory.")
    return {
        "metadata": {"name": name, "labels": {HASH_LABEL: "h"}, "creationTimestamp": created},
        "spec": {"nodeName": "n1"},
        "status": status,
    }


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


def status_of(pods, replicas=1, generation=2, **kw):
    observed = [observe_pod(p, "ibm.com/spyre_pf", HASH_LABEL, now=NOW) for p in pods]
    return compute_status(
        generation=generation,
        replicas=replicas,
        template_hash="h",
        pods=[v for v, _ in observed],
        health=[h for _, h in observed],
        selector="s",
        service_address=None,
        card_resource="ibm.com/spyre_pf",
        **kw,
    )


def kstatus(obj: dict) -> str:
    """kstatus's documented rules for a custom resource: observedGeneration behind -> InProgress;
    Stalled=True -> Failed; Reconciling=True -> InProgress; otherwise Current."""
    st = obj["status"]
    if st.get("observedGeneration") != obj["metadata"]["generation"]:
        return "InProgress"
    conds = {c["type"]: c["status"] for c in st.get("conditions") or []}
    if conds.get("Stalled") == "True":
        return "Failed"
    if conds.get("Reconciling") == "True":
        return "InProgress"
    return "Current"


@pytest.mark.parametrize(
    ("state", "pods", "kw", "generation", "expected", "ready"),
    [
        ("ready", [pod("a")], {}, 2, "Current", "True"),
        ("warming", [pod("a", ready=False)], {}, 2, "InProgress", "False"),
        ("no-pods-yet", [], {}, 2, "InProgress", "False"),
        ("stale-generation", [pod("a")], {}, 3, "InProgress", "True"),
        ("invalid-spec", [], {"invalid": "spec.cards: must be one of 1, 2, 4, 8"}, 2, "Failed", "False"),
        (
            "crash-loop",
            [pod("a", ready=False, waiting="CrashLoopBackOff", last_message="x")],
            {},
            2,
            "Failed",
            "False",
        ),
        ("image-never-pulls", [pod("a", ready=False, waiting="ImagePullBackOff")], {}, 2, "Failed", "False"),
        (
            "pod-rejected",
            [],
            {"problems": (Problem("PodRejected", 'Pod "x" is invalid'),)},
            2,
            "Failed",
            "False",
        ),
        (
            "api-error-retrying",
            [pod("a")],
            {"problems": (Problem("APIError", "503", False),)},
            2,
            "InProgress",
            "False",
        ),
        (
            "quota",
            [],
            {"problems": (Problem("QuotaExceeded", "exceeded quota", False),)},
            2,
            "InProgress",
            "False",
        ),
        ("suspended", [], {"suspended": True}, 2, "Current", "False"),
    ],
)
def test_kstatus_reads_every_state(state, pods, kw, generation, expected, ready):
    status = status_of(pods, **kw)
    obj = {"metadata": {"generation": generation}, "status": status}
    assert kstatus(obj) == expected, state
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Ready"]["status"] == ready  # Ready is always present
    if expected == "Failed":
        assert conds["Stalled"]["message"] and conds["Ready"]["reason"] == conds["Stalled"]["reason"]


def test_clone_pod_keeps_template_and_drops_node():
    src = {
        "metadata": {"name": "m-abc-x1", "generateName": "m-abc-", "namespace": "ns", "labels": {"a": "b"}},
        "spec": {"nodeName": "n1", "containers": [{"name": "runtime"}]},
        "status": {"phase": "Running"},
    }
    c = clone_pod(src)
    assert c["metadata"] == {
        "generateName": "m-abc-",
        "namespace": "ns",
        "labels": {"a": "b"},
        "ownerReferences": [],
    }
    assert "nodeName" not in c["spec"] and "status" not in c


def test_work_queue_coalesces_serializes_and_backs_off():
    seen: list[tuple[str, float]] = []
    running: set[str] = set()
    overlap = []
    fail_first = {"b"}
    gate = threading.Event()

    def process(key):
        if key in running:
            overlap.append(key)
        running.add(key)
        seen.append((key, time.monotonic()))
        if key == "a":
            gate.wait(2)
        running.discard(key)
        if key in fail_first:
            fail_first.discard(key)
            return Result(failed=True)
        return None

    q = WorkQueue(process, workers=3, base_delay=0.3)
    q.start()
    try:
        q.add("a")
        time.sleep(0.1)
        for _ in range(5):  # while "a" runs: coalesced into one more pass
            q.add("a")
        q.add("b")
        time.sleep(0.2)
        gate.set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (
            sum(k == "a" for k, _ in seen) < 2 or sum(k == "b" for k, _ in seen) < 2
        ):
            time.sleep(0.05)
    finally:
        q.stop()
    assert not overlap
    assert sum(k == "a" for k, _ in seen) == 2
    b_times = [t for k, t in seen if k == "b"]
    assert len(b_times) == 2 and b_times[1] - b_times[0] >= 0.25  # retried after the back-off
    assert q.failures("b") == 0


def test_bucket_ranges_reach_the_pod_environment():
    from spyre_operator.spec.runtime_contract import runtime_env

    batching = {"mode": "continuous", "maxNumSeqs": 8, "maxModelLen": 512}
    batching["decodeBatchBuckets"] = {"min": 1, "step": 4, "max": 8}
    batching["kvBuckets"] = {"min": 128, "step": 128, "max": 512}
    spec = parse_spec("m", {**BASE, "batching": batching})
    check_runtime_contract(spec)
    env = {v["name"]: v.get("value") for v in runtime_env(spec)}
    assert env["SENDNN_INFERENCE_CB_DECODE_BATCH_BUCKETS"] == "1,4,8"
    assert env["SENDNN_INFERENCE_CB_KV_BUCKETS"] == "128,128,512"


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_example_is_a_valid_spec(path):
    import yaml

    models = [d for d in yaml.safe_load_all(path.read_text()) if d["kind"] == "SpyreModel"]
    for doc in models:
        check_runtime_contract(check_spec(doc["metadata"]["name"], doc["spec"], OperatorSettings()))
    # an autoscaler's example drives a SpyreModel of the examples
    assert models or path.stem in ("hpa", "keda-scaledobject")


def test_pooling_task_pod_gets_task_flag_and_pooling_shapes():
    from spyre_operator.kinds.pods.template import pod_template
    from spyre_operator.settings import OperatorSettings

    shapes = [{"promptLength": 64, "batchSize": 8}, {"promptLength": 256, "batchSize": 2}]
    spec = parse_spec("e", {**BASE, "task": "embed", "batching": {"mode": "static", "shapes": shapes}})
    check_runtime_contract(spec)
    c = pod_template("e", spec, OperatorSettings())["containers"][0]
    assert c["args"][c["args"].index("--task") + 1] == "embed"
    env = {v["name"]: v.get("value") for v in c["env"]}
    assert env["SENDNN_INFERENCE_WARMUP_PROMPT_LENS"] == "64,256"
    assert env["SENDNN_INFERENCE_WARMUP_BATCH_SIZES"] == "8,2"
    assert "SENDNN_INFERENCE_WARMUP_NEW_TOKENS" not in env
    with pytest.raises(InvalidSpec, match="pooling models run on one card"):
        check_runtime_contract(
            parse_spec("e", {**BASE, "task": "embed", "cards": 2, "batching": {"shapes": shapes}})
        )
    with pytest.raises(InvalidSpec, match="static warm-up shapes"):
        parse_spec(
            "e",
            {
                **BASE,
                "task": "rerank",
                "batching": {"mode": "continuous", "maxNumSeqs": 2, "maxModelLen": 128},
            },
        )
    generate = pod_template("g", parse_spec("g", BASE), OperatorSettings())["containers"][0]
    assert "--task" not in generate["args"]


def test_card_tiers_shared_memory_and_startup_budget():
    from spyre_operator.kinds.pods.template import pod_template, startup_failure_threshold
    from spyre_operator.settings import OperatorSettings, SettingsError, load_settings

    tiered = OperatorSettings(card_resource="ibm.com/aiu_pf", card_tiers=(4, 8, 16))
    for cards, tier in ((1, 0), (4, 0), (8, 1)):
        pod = pod_template("m", parse_spec("m", {**BASE, "cards": cards}), tiered)
        assert pod["containers"][0]["resources"]["limits"] == {f"ibm.com/aiu_pf_tier{tier}": str(cards)}
    with pytest.raises(InvalidSpec, match="fit no card tier"):
        pod_template("m", parse_spec("m", {**BASE, "cards": 8}), OperatorSettings(card_tiers=(4,)))
    assert load_settings({"SPYRE_OPERATOR_CARD_TIERS": "4,8,16"}).card_tiers == (4, 8, 16)
    with pytest.raises(SettingsError, match="SPYRE_OPERATOR_CARD_TIERS"):
        load_settings({"SPYRE_OPERATOR_CARD_TIERS": "8,4"})
    vols = {
        v["name"]: v
        for v in pod_template("m", parse_spec("m", {**BASE, "cards": 4}), OperatorSettings())["volumes"]
    }
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    one = {v["name"]: v for v in pod_template("m", parse_spec("m", BASE), OperatorSettings())["volumes"]}
    assert one["dshm"]["emptyDir"] == {"medium": "Memory"}
    settings = OperatorSettings()
    cold = startup_failure_threshold(parse_spec("m", BASE), settings)
    warm = startup_failure_threshold(parse_spec("m", {**BASE, "graphCache": {"precompile": True}}), settings)
    more = {"shapes": [{"promptLength": 64 * i, "newTokens": 8, "batchSize": 1} for i in (1, 2, 3, 4)]}
    assert warm < cold < startup_failure_threshold(parse_spec("m", {**BASE, "batching": more}), settings)


def test_memory_plan_and_known_configurations_before_any_pod():
    from spyre_operator.settings import OperatorSettings
    from spyre_operator.spec.parse import UnknownConfiguration
    from spyre_operator.spec.runtime_contract import check_fit

    from tests.operator.catalog import LLAMA_70B

    big = {"source": "pvc://models/big", "config": LLAMA_70B}
    settings = OperatorSettings()
    with pytest.raises(InvalidSpec, match="largest consumer is the weights"):
        check_fit(parse_spec("m", {**BASE, "backend": "sendnn", "model": big}), settings)
    check_fit(
        parse_spec("m", {**BASE, "backend": "sendnn", "cards": 8, "model": big}), settings
    )  # 8 cards fit
    on_cpu = {**BASE, "model": big, "resources": {"limits": {"memory": "64Gi"}}}
    with pytest.raises(InvalidSpec, match="container memory"):
        check_fit(parse_spec("m", on_cpu), settings)
    known = {"source": "pvc://models/x", "architecture": "LlamaForCausalLM"}
    with pytest.raises(UnknownConfiguration) as err:
        check_fit(
            parse_spec("m", {**BASE, "cards": 8, "model": known}), OperatorSettings(require_known_config=True)
        )
    assert err.value.reason == "UnknownConfiguration" and "nearest" in str(err.value)
    with pytest.raises(InvalidSpec, match=r"model\.architecture"):
        check_fit(parse_spec("m", {**BASE, "requireKnownConfiguration": True}), settings)


def test_warming_pods_progress_reaches_the_progressing_message():
    import http.server
    import json as _json
    import threading as _threading

    from spyre_operator.status.report import warmup_progress

    class Warming(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = _json.dumps({"status": "warming up", "warming": {"done": 7, "total": 12}}).encode()
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Warming)
    _threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        warm = pod("w", ready=False)
        warm["status"]["podIP"] = "127.0.0.1"
        pods = [pod("a"), warm]
        observed = [observe_pod(p, "ibm.com/spyre_pf", HASH_LABEL, now=NOW) for p in pods]
        progress = warmup_progress(pods, observed, server.server_address[1])
    finally:
        server.shutdown()
    assert progress == {"w": (7, 12)}
    status = status_of(pods, replicas=2, warming=progress)
    msg = {c["type"]: c for c in status["conditions"]}["Progressing"]["message"]
    assert msg.endswith("w: compiling 7/12")
