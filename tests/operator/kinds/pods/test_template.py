"""The serving pod's template: cards, env, volumes, probes, security, hashes, flags, start-up budget."""

from __future__ import annotations

import pytest
from spyre_operator.kinds.pods.template import (
    PROBE_PERIOD,
    build_pod,
    clone_pod,
    pod_template,
    startup_failure_threshold,
    template_hash,
)
from spyre_operator.settings import HASH_LABEL, MODEL_LABEL, OperatorSettings, SettingsError, load_settings
from spyre_operator.spec.model_spec import InvalidSpec
from spyre_operator.spec.parse import parse_spec
from spyre_operator.spec.runtime_contract import check_runtime_contract

from tests.operator.catalog import BASE
from tests.operator.objects import MODEL, env_of, spec_of


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
    # a deleted pod admits requests a while longer (until the endpoints forget it), then drains in the grace
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > 5 + 30  # the runtime drains for up to 30 s
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
            "granite",
            spec_of(
                batching={"mode": "static", "shapes": [{"promptLength": 64, "newTokens": 8, "batchSize": 1}]}
            ),
            s,
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


def test_dtypes_reach_the_pod_environment_only_when_set():
    """spec.dtype and spec.kvCacheDtype become the runtime's variables, which the runtime's contract reads
    back; auto is the runtime's own default, so the pod is not told."""
    settings = OperatorSettings()
    narrow = spec_of(dtype="float32", kvCacheDtype="bfloat16")
    env = env_of(build_pod(MODEL, narrow, settings))
    assert env["SENDNN_INFERENCE_DTYPE"] == "float32" and env["SENDNN_INFERENCE_KV_CACHE_DTYPE"] == "bfloat16"
    read = check_runtime_contract(narrow)
    assert (read.dtype, read.kv_cache_dtype) == ("float32", "bfloat16")
    default = env_of(build_pod(MODEL, spec_of(), settings))
    assert "SENDNN_INFERENCE_DTYPE" not in default and "SENDNN_INFERENCE_KV_CACHE_DTYPE" not in default
    model_dtype = spec_of(dtype="float32")
    assert build_pod(MODEL, spec_of(dtype="float32", kvCacheDtype="auto"), settings) == build_pod(
        MODEL, model_dtype, settings
    )
    # a new KV cache dtype is a new pod template: the pods roll
    assert template_hash(pod_template("granite", narrow, settings)) != template_hash(
        pod_template("granite", model_dtype, settings)
    )


def test_a_generate_model_without_a_batching_mode_runs_continuous_batching():
    spec = spec_of(batching={"maxNumSeqs": 8, "maxModelLen": 2048})
    assert spec.mode == "continuous" and spec.shapes == ()
    check_runtime_contract(spec)
    pod = build_pod(MODEL, spec, OperatorSettings())
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "8" and args[args.index("--max-model-len") + 1] == "2048"
    env = env_of(pod)
    assert env["SENDNN_INFERENCE_USE_CB"] == "1"
    assert not [name for name in env if name.startswith("SENDNN_INFERENCE_WARMUP_")]
    # the same pod as with the mode said
    said = spec_of(batching={"mode": "continuous", "maxNumSeqs": 8, "maxModelLen": 2048})
    assert build_pod(MODEL, said, OperatorSettings()) == pod
    with pytest.raises(InvalidSpec, match=r"needs maxNumSeqs and maxModelLen \(continuous is the default"):
        parse_spec("m", {key: value for key, value in BASE.items() if key != "batching"})


@pytest.mark.parametrize("task", ["embed", "score", "rerank"])
def test_a_pooling_model_without_a_batching_mode_stays_static(task):
    shapes = [{"promptLength": 64, "batchSize": 8}, {"promptLength": 256, "batchSize": 2}]
    spec = parse_spec("e", {**BASE, "task": task, "batching": {"shapes": shapes}})
    assert spec.mode == "static"
    check_runtime_contract(spec)
    env = env_of(build_pod(MODEL, spec, OperatorSettings()))
    assert env["SENDNN_INFERENCE_USE_CB"] == "0"
    assert (env["SENDNN_INFERENCE_WARMUP_PROMPT_LENS"], env["SENDNN_INFERENCE_WARMUP_BATCH_SIZES"]) == (
        "64,256",
        "8,2",
    )
    with pytest.raises(InvalidSpec, match="static batching needs at least one shape"):
        parse_spec("e", {**BASE, "task": task, "batching": {}})


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
    from spyre_operator.settings import OperatorSettings

    tiered = OperatorSettings(card_resource="ibm.com/aiu_pf", card_tiers=(4, 8, 16))
    for cards, tier in ((2, 0), (4, 0), (8, 1)):
        pod = pod_template("m", parse_spec("m", {**BASE, "cards": cards}), tiered)
        assert pod["containers"][0]["resources"]["limits"] == {f"ibm.com/aiu_pf_tier{tier}": str(cards)}
    # one card is no tensor-parallel job: it stays on the plain resource, tiers or not
    single = pod_template("m", parse_spec("m", {**BASE, "cards": 1}), tiered)
    assert single["containers"][0]["resources"]["limits"] == {"ibm.com/aiu_pf": "1"}
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
    more = {
        "mode": "static",
        "shapes": [{"promptLength": 64 * i, "newTokens": 8, "batchSize": 1} for i in (1, 2, 3, 4)],
    }
    assert warm < cold < startup_failure_threshold(parse_spec("m", {**BASE, "batching": more}), settings)
