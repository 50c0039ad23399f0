"""Pure operator logic without a cluster: settings, spec rules, builders, the pod plan, status."""

import pytest
from spyre_operator.kinds.graph_cache_claim import build_cache_claim
from spyre_operator.kinds.pods.observe import PodHealth, observe_pod
from spyre_operator.kinds.pods.plan import PodPlan, PodView, plan_pods
from spyre_operator.kinds.pods.template import (
    PROBE_PERIOD,
    build_pod,
    pod_template,
    startup_failure_threshold,
    template_hash,
)
from spyre_operator.kinds.service import build_service
from spyre_operator.settings import HASH_LABEL, MODEL_LABEL, OperatorSettings, SettingsError, load_settings
from spyre_operator.spec.model_spec import InvalidSpec
from spyre_operator.spec.parse import parse_spec
from spyre_operator.status.conditions import compute_status, merge_conditions, status_changed

MODEL = {
    "apiVersion": "spyre-serve.io/v1alpha1",
    "kind": "SpyreModel",
    "metadata": {"name": "granite", "namespace": "ml", "uid": "u-1", "generation": 3},
    "spec": {
        "model": {"source": "pvc://models/granite-3b"},
        "cards": 4,
        "replicas": 2,
        "backend": "inductor",
        "batching": {
            "mode": "static",
            "shapes": [
                {"promptLength": 128, "newTokens": 64, "batchSize": 4},
                {"promptLength": 64, "newTokens": 20, "batchSize": 1},
            ],
        },
    },
}


def spec_of(**changes):
    return parse_spec("granite", {**MODEL["spec"], **changes})


def env_of(pod):
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_settings_env_and_flags():
    import argparse

    s = load_settings({"SPYRE_OPERATOR_CARD_RESOURCE": "ibm.com/aiu_pf", "SPYRE_OPERATOR_NAMESPACES": "a, b"})
    assert s.card_resource == "ibm.com/aiu_pf" and s.namespaces == ("a", "b")
    flags = argparse.Namespace(card_resource="ibm.com/spyre_pf", scheduler_name="spyre-scheduler")
    s = load_settings({"SPYRE_OPERATOR_CARD_RESOURCE": "ibm.com/aiu_pf"}, flags)
    assert (s.card_resource, s.scheduler_name) == ("ibm.com/spyre_pf", "spyre-scheduler")
    with pytest.raises(SettingsError, match="SPYRE_OPERATOR_CARD_RESOURCE='cards'"):
        load_settings({"SPYRE_OPERATOR_CARD_RESOURCE": "cards"})
    with pytest.raises(SettingsError, match="SPYRE_OPERATOR_RESYNC_SECONDS='-1' must be positive"):
        load_settings({"SPYRE_OPERATOR_RESYNC_SECONDS": "-1"})


def test_every_setting_has_a_parse_rule():
    from dataclasses import fields

    from spyre_operator.settings import ENV, PARSE

    assert list(PARSE) != [] and set(PARSE) == set(ENV) <= {f.name for f in fields(OperatorSettings)}


@pytest.mark.parametrize(
    ("changes", "field", "rule"),
    [
        ({"model": {}}, "model.source", "is required"),
        (
            {"model": {"source": "http://hub/model"}},
            "model.source",
            "must be one of pvc://CLAIM/PATH, file:///PATH",
        ),
        ({"cards": 3}, "cards", "must be one of 1, 2, 4, 8"),
        ({"replicas": -1}, "replicas", "must be at least 0"),
        ({"backend": "cuda"}, "backend", "must be one of sendnn, inductor, eager"),
        ({"batching": {"mode": "dynamic"}}, "batching.mode", "must be static or continuous"),
        ({"batching": {"mode": "static", "shapes": []}}, "batching.shapes", "at least one shape"),
        (
            {"batching": {"shapes": [{"promptLength": 100, "newTokens": 1, "batchSize": 1}]}},
            "batching.shapes[0].promptLength",
            "multiple of 64",
        ),
        (
            {"batching": {"shapes": [{"promptLength": 64, "newTokens": 0, "batchSize": 1}]}},
            "batching.shapes[0].newTokens",
            "at least 1",
        ),
        (
            {"batching": {"mode": "continuous", "maxNumSeqs": 4}},
            "batching",
            "needs maxNumSeqs and maxModelLen",
        ),
        (
            {
                "batching": {
                    "mode": "continuous",
                    "maxNumSeqs": 4,
                    "maxModelLen": 256,
                    "maxNumBatchedTokens": 100,
                }
            },
            "batching.maxNumBatchedTokens",
            "multiple of 64",
        ),
        (
            {"graphCache": {"existingClaim": "c", "storageClassName": "nfs"}},
            "graphCache",
            "exclude each other",
        ),
        ({"graphCache": {"size": "lots"}}, "graphCache.size", "quantity"),
        ({"env": [{"value": "x"}]}, "env[0]", "must be an object with a name"),
    ],
)
def test_every_rule_names_field_and_rule(changes, field, rule):
    with pytest.raises(InvalidSpec) as err:
        spec_of(**changes)
    assert err.value.field_path == field and rule in err.value.rule
    assert str(err.value).startswith(f"spec.{field}: ")


def test_pod_has_cards_env_volumes_probes_and_security():
    settings = OperatorSettings(card_resource="ibm.com/aiu_pf", scheduler_name="aiu-scheduler")
    pod = build_pod(MODEL, spec_of(), settings)
    c = pod["spec"]["containers"][0]
    assert c["resources"]["requests"]["ibm.com/aiu_pf"] == "4" == c["resources"]["limits"]["ibm.com/aiu_pf"]
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "4"
    assert c["args"][1] == "/models/granite-3b"
    env = env_of(pod)
    assert env["SENDNN_INFERENCE_DYNAMO_BACKEND"] == "inductor" and env["SENDNN_INFERENCE_USE_CB"] == "0"
    assert env["SENDNN_INFERENCE_WARMUP_PROMPT_LENS"] == "128,64"
    assert env["SENDNN_INFERENCE_WARMUP_NEW_TOKENS"] == "64,20"
    assert env["SENDNN_INFERENCE_WARMUP_BATCH_SIZES"] == "4,1"
    assert env["TORCH_SENDNN_CACHE_ENABLE"] == "1" and env["TORCH_SENDNN_CACHE_DIR"] == "/cache/graphs"
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["graph-cache"]["persistentVolumeClaim"]["claimName"] == "granite-graph-cache"
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    assert vols["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 2 * 600
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "readOnlyRootFilesystem": True,
    }
    # no fixed user or group (OpenShift's restricted SCC assigns them) unless the settings pin them
    assert pod["spec"]["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "fsGroupChangePolicy": "OnRootMismatch",
    }
    pinned = build_pod(MODEL, spec_of(), OperatorSettings(run_as_user=1000, fs_group=2000))
    assert pinned["spec"]["securityContext"]["runAsUser"] == 1000
    assert pinned["spec"]["securityContext"]["fsGroup"] == 2000
    assert env["HOME"] == "/tmp" and "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}
    annotated = build_pod(MODEL, spec_of(), OperatorSettings(prometheus_annotations=True))
    assert annotated["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert "annotations" not in pod["metadata"]
    assert pod["spec"]["schedulerName"] == "aiu-scheduler"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert pod["metadata"]["labels"][MODEL_LABEL] == "granite"


def test_builders_are_deterministic_and_hash_follows_the_spec():
    s = OperatorSettings()
    assert build_pod(MODEL, spec_of(), s) == build_pod(MODEL, spec_of(), s)
    h1 = template_hash(pod_template("granite", spec_of(), s))
    h2 = template_hash(pod_template("granite", spec_of(replicas=5), s))
    h3 = template_hash(
        pod_template(
            "granite", spec_of(batching={"shapes": [{"promptLength": 64, "newTokens": 8, "batchSize": 1}]}), s
        )
    )
    assert h1 == h2 != h3
    assert build_pod(MODEL, spec_of(), s)["metadata"]["labels"][HASH_LABEL] == h1


def test_continuous_batching_flags_and_user_env_override():
    spec = spec_of(
        batching={"mode": "continuous", "maxNumSeqs": 8, "maxModelLen": 2048},
        env=[{"name": "SENDNN_INFERENCE_DYNAMO_BACKEND", "value": "eager"}, {"name": "X", "value": "1"}],
    )
    pod = build_pod(MODEL, spec, OperatorSettings())
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "8" and args[args.index("--max-model-len") + 1] == "2048"
    env = env_of(pod)
    assert env["SENDNN_INFERENCE_USE_CB"] == "1" and "SENDNN_INFERENCE_WARMUP_PROMPT_LENS" not in env
    assert env["SENDNN_INFERENCE_DYNAMO_BACKEND"] == "eager" and env["X"] == "1"
    assert "--max-num-batched-tokens" not in args  # the runtime's default chunk size


def test_chunk_size_maps_to_the_flag_and_the_startup_budget_counts_buckets():
    settings = OperatorSettings(startup_seconds_per_shape=100)
    small = spec_of(
        batching={"mode": "continuous", "maxNumSeqs": 1, "maxModelLen": 64, "maxNumBatchedTokens": 64}
    )
    big = spec_of(
        batching={"mode": "continuous", "maxNumSeqs": 8, "maxModelLen": 2048, "maxNumBatchedTokens": 512}
    )
    args = build_pod(MODEL, big, settings)["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-batched-tokens") + 1] == "512"
    # small: 1 chunk + 1x1 decode = 2 graphs -> 1 shape;
    # big: 5 chunks (64, 128, 192, 256, 512) + 4 batch x 6 KV buckets = 29 graphs -> 15 shapes
    assert startup_failure_threshold(small, settings) == max(6, (60 + 100) // PROBE_PERIOD)
    assert startup_failure_threshold(big, settings) == (60 + 15 * 100) // PROBE_PERIOD


def test_service_and_claim():
    s = OperatorSettings(default_storage_class="nfs")
    svc = build_service(MODEL, s)
    assert svc["spec"]["selector"] == {MODEL_LABEL: "granite"} and svc["spec"]["ports"][0]["port"] == 8000
    claim = build_cache_claim(MODEL, spec_of(), s)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and claim["spec"]["storageClassName"] == "nfs"
    assert "ownerReferences" not in claim["metadata"]  # Retain by default
    deleting = build_cache_claim(MODEL, spec_of(graphCache={"retention": "Delete"}), s)
    assert deleting["metadata"]["ownerReferences"][0]["kind"] == "SpyreModel"
    assert build_cache_claim(MODEL, spec_of(graphCache={"existingClaim": "shared"}), s) is None
    pod = build_pod(MODEL, spec_of(graphCache={"existingClaim": "shared"}), s)
    assert {v["name"]: v for v in pod["spec"]["volumes"]}["graph-cache"]["persistentVolumeClaim"][
        "claimName"
    ] == "shared"


def P(name, h="new", ready=False, term=False, cards=False, created="2026-01-01T00:00:00Z"):
    return PodView(name, h, ready, term, cards, created)


@pytest.mark.parametrize(
    ("replicas", "pods", "suspend", "expected"),
    [
        (2, [], False, PodPlan(2, ())),
        (2, [P("a", ready=True), P("b")], False, PodPlan(0, ())),
        # surge: new pods first, old pods stay while new ones warm up
        (2, [P("o1", "old", True), P("o2", "old", True)], False, PodPlan(2, ())),
        (2, [P("o1", "old", True), P("o2", "old", True), P("n1"), P("n2")], False, PodPlan(0, ())),
        # one new pod ready -> one old leaves
        (
            2,
            [P("o1", "old", True), P("o2", "old", True), P("n1", ready=True), P("n2")],
            False,
            PodPlan(0, ("o1",)),
        ),
        # unready old pods leave at once
        (2, [P("o1", "old"), P("n1"), P("n2")], False, PodPlan(0, ("o1",))),
        # scarce cards: a new pod cannot be scheduled -> free one old pod
        (
            2,
            [P("o1", "old", True), P("o2", "old", True), P("n1", cards=True), P("n2", cards=True)],
            False,
            PodPlan(0, ("o1",)),
        ),
        # ... but never a second while one old pod is still terminating
        (
            2,
            [P("o1", "old", True, term=True), P("o2", "old", True), P("n1", cards=True), P("n2", cards=True)],
            False,
            PodPlan(0, ()),
        ),
        # scale down: unready first, then newest
        (
            1,
            [P("a", ready=True, created="1"), P("b", ready=True, created="2"), P("c", created="0")],
            False,
            PodPlan(0, ("c", "b")),
        ),
        (0, [P("a", ready=True)], False, PodPlan(0, ("a",))),
        # terminating pods are not counted
        (1, [P("a", term=True)], False, PodPlan(1, ())),
        (3, [P("a", ready=True), P("b", "old")], True, PodPlan(0, ("a", "b"))),
    ],
)
def test_plan_table(replicas, pods, suspend, expected):
    plan = plan_pods(replicas, "new", pods, suspend)
    assert (plan.create, sorted(plan.delete)) == (expected.create, sorted(expected.delete))


def pod_dict(name, *, ready=False, unsched="", crash=False, h="h1", phase=None, node="", bound_at=""):
    """A pod's body: Running (warming up, or Ready) unless unschedulable or given another phase."""
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unsched:
        conditions.append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unsched}
        )
    if bound_at:
        conditions.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": bound_at})
    status = {"conditions": conditions, "phase": phase or ("Pending" if unsched else "Running")}
    if crash:
        status["containerStatuses"] = [
            {
                "name": "runtime",
                "restartCount": 4,
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"reason": "Error", "exitCode": 2}},
            }
        ]
    return {
        "metadata": {"name": name, "labels": {HASH_LABEL: h}, "creationTimestamp": "t"},
        "spec": {"nodeName": node} if node else {},
        "status": status,
    }


def status_for(pods, replicas=2, now=None, **kw):
    observed = [observe_pod(p, "ibm.com/spyre_pf", HASH_LABEL, now=now) for p in pods]
    return compute_status(
        generation=3,
        replicas=replicas,
        template_hash="h1",
        pods=[v for v, _ in observed],
        health=[h for _, h in observed],
        selector="s",
        service_address="http://x",
        card_resource="ibm.com/spyre_pf",
        **kw,
    )


def cond(status, type_):
    return {c["type"]: c for c in status["conditions"]}[type_]


def test_status_cases():
    ready = status_for([pod_dict("a", ready=True), pod_dict("b", ready=True)])
    assert ready["phase"] == "Ready" and cond(ready, "Ready")["status"] == "True"
    assert ready["readyReplicas"] == 2 and ready["observedGeneration"] == 3
    warming = status_for([pod_dict("a", ready=True), pod_dict("b")])
    assert cond(warming, "Progressing")["reason"] == "Warming" and cond(warming, "Ready")["status"] == "False"
    cards = status_for(
        [
            pod_dict("a", ready=True),
            pod_dict("b", unsched="0/2 nodes are available: 2 Insufficient ibm.com/spyre_pf."),
        ]
    )
    assert cond(cards, "Progressing")["reason"] == "WaitingForCards"
    crash = status_for([pod_dict("a", ready=True), pod_dict("b", crash=True)])
    assert cond(crash, "Degraded")["reason"] == "CrashLoop" and "code 2" in cond(crash, "Degraded")["message"]
    assert crash["phase"] == "Degraded"
    invalid = status_for([], invalid="spec.cards: must be one of 1, 2, 4, 8, got 3")
    assert cond(invalid, "Ready")["reason"] == "InvalidSpec" and cond(invalid, "Degraded")["status"] == "True"
    suspended = status_for([], suspended=True)
    assert suspended["phase"] == "Suspended" and cond(suspended, "Ready")["reason"] == "Suspended"


def test_pods_that_have_not_started_are_never_said_to_compile():
    import datetime

    now = datetime.datetime(2026, 11, 25, 12, 0, 0, tzinfo=datetime.UTC)
    bound = {"phase": "Pending", "node": "spyre-node-1", "bound_at": "2026-11-25T11:58:20Z"}  # 100 s ago
    ready = pod_dict("a", ready=True)
    starting = status_for([ready, pod_dict("b", **bound)], now=now, start_grace_seconds=300)
    progressing = cond(starting, "Progressing")
    assert progressing["reason"] == "Starting" and progressing["message"].endswith(
        "starting: b on spyre-node-1"
    )
    unscheduled = status_for([ready, pod_dict("b", phase="Pending")], now=now)
    assert cond(unscheduled, "Progressing")["message"].endswith("starting: b (not scheduled yet)")
    stuck = status_for([ready, pod_dict("b", **bound)], now=now, start_grace_seconds=60)
    progressing = cond(stuck, "Progressing")
    assert progressing["reason"] == "NotStarted" == cond(stuck, "Ready")["reason"]
    assert progressing["message"] == "pod b is bound to node spyre-node-1 and has not started after 100 s"
    assert cond(stuck, "Reconciling")["status"] == "True" and cond(stuck, "Stalled")["status"] == "False"
    # one pod warming up, another one not started: the one not started is what the condition says
    mixed = status_for(
        [ready, pod_dict("b"), pod_dict("c", **bound)], replicas=3, now=now, start_grace_seconds=60
    )
    assert cond(mixed, "Progressing")["reason"] == "NotStarted"
    claim = status_for(
        [ready, pod_dict("b", unsched='0/2 nodes are available: 2 persistentvolumeclaim "cache" not found.')]
    )
    progressing = cond(claim, "Progressing")
    assert (
        progressing["reason"] == "WaitingForClaim"
        and 'persistentvolumeclaim "cache" not found' in (progressing["message"])
    )
    dra = status_for([ready, pod_dict("b", unsched="0/2 nodes are available: 2 cannot allocate all claims.")])
    assert cond(dra, "Progressing")["reason"] == "WaitingForCards"
    taints = "0/2 nodes are available: 2 node(s) didn't match node selector."
    elsewhere = status_for([ready, pod_dict("b", unsched=taints)])
    assert cond(elsewhere, "Progressing")["reason"] == "Unschedulable"
    assert cond(elsewhere, "Progressing")["message"] == taints == cond(elsewhere, "Reconciling")["message"]


def test_status_written_only_when_changed_and_transition_times_kept():
    s1 = merge_conditions(status_for([pod_dict("a", ready=True), pod_dict("b")]), None)
    again = status_for([pod_dict("a", ready=True), pod_dict("b")])
    assert not status_changed(again, s1)
    s2 = merge_conditions(status_for([pod_dict("a", ready=True), pod_dict("b", ready=True)]), s1)
    assert status_changed(s2, s1)
    assert cond(s2, "Degraded")["lastTransitionTime"] == cond(s1, "Degraded")["lastTransitionTime"]
    assert PodHealth("x").failure_reason is None


def test_compile_job_and_cache_key():
    from spyre_operator.kinds.compile_job import build_compile_job, cache_key

    s = OperatorSettings()
    pre = spec_of(graphCache={"precompile": True})
    key = cache_key(pre, s)
    assert key == cache_key(spec_of(graphCache={"precompile": True}), s)  # deterministic
    other = spec_of(
        graphCache={"precompile": True},
        batching={"shapes": [{"promptLength": 128, "newTokens": 8, "batchSize": 1}]},
    )
    assert cache_key(other, s) != key
    assert cache_key(spec_of(graphCache={"precompile": True}, cards=2), s) != key
    job = build_compile_job(MODEL, pre, s, key)
    assert job["kind"] == "Job" and job["metadata"]["name"] == f"granite-compile-{key[:10]}"
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert MODEL_LABEL not in labels  # not counted as a replica
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:2] == ["compile", pre.source.path_in_pod]
    assert s.card_resource not in container["resources"].get("requests", {})
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    job_env = {e["name"] for e in container["env"]}
    assert (
        "TORCH_SENDNN_CACHE_DIR" in job_env and "SENDNN_INFERENCE_REQUIRE_PRECOMPILED_DECODERS" not in job_env
    )
    pod_env = env_of(build_pod(MODEL, pre, s))
    assert pod_env["SENDNN_INFERENCE_REQUIRE_PRECOMPILED_DECODERS"] == "1"
    assert "SENDNN_INFERENCE_REQUIRE_PRECOMPILED_DECODERS" not in env_of(build_pod(MODEL, spec_of(), s))
    with pytest.raises(InvalidSpec, match=r"graphCache\.precompile"):
        spec_of(graphCache={"precompile": True, "enabled": False})


@pytest.mark.parametrize(
    ("job_status", "ready", "failed", "reason"),
    [
        (None, False, False, "Compiling"),
        ({}, False, False, "Compiling"),
        ({"succeeded": 1}, True, False, "Compiled"),
        (
            {
                "failed": 2,
                "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}],
            },
            False,
            True,
            "CompileJobFailed",
        ),
    ],
)
def test_observe_job_and_cache_status(job_status, ready, failed, reason):
    from spyre_operator.kinds.compile_job import observe_job

    job = None if job_status is None else {"metadata": {"name": "m-compile-k"}, "status": job_status}
    state = observe_job(job, "k")
    assert (state.is_ready, state.is_failed, state.reason) == (ready, failed, reason)
    status = compute_status(
        generation=3,
        replicas=1,
        template_hash="new",
        pods=[PodView("old-1", "old", is_ready=True, created="2026-01-01T00:00:00Z")],
        health=[],
        selector="s",
        service_address=None,
        card_resource="ibm.com/spyre_pf",
        cache=state,
    )
    conds = {c["type"]: c for c in status["conditions"]}
    assert status["cacheKey"] == "k" and conds["CacheReady"]["status"] == ("True" if ready else "False")
    if not ready:
        assert conds["Progressing"]["reason"] == "WaitingForCache"
    assert (conds["Degraded"]["reason"] == "CompileJobFailed") is failed
    if failed:
        assert "BackoffLimitExceeded" in conds["Degraded"]["message"] and status["phase"] == "Degraded"


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
