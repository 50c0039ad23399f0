"""The compile Job as built, its cache key, and what is read off it."""

from __future__ import annotations

import pytest
from spyre_operator.kinds.pods.plan import PodView
from spyre_operator.kinds.pods.template import (
    build_pod,
)
from spyre_operator.settings import MODEL_LABEL, OperatorSettings
from spyre_operator.spec.model_spec import InvalidSpec
from spyre_operator.status.conditions import compute_status

from tests.operator.objects import MODEL, env_of, spec_of


def test_compile_job_and_cache_key():
    from spyre_operator.kinds.compile_job import build_compile_job, cache_key

    s = OperatorSettings()
    pre = spec_of(graphCache={"precompile": True})
    key = cache_key(pre, s)
    assert key == cache_key(spec_of(graphCache={"precompile": True}), s)  # deterministic
    other = spec_of(
        graphCache={"precompile": True},
        batching={"mode": "static", "shapes": [{"promptLength": 128, "newTokens": 8, "batchSize": 1}]},
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


def test_a_kv_cache_dtype_is_a_compile_configuration_of_its_own():
    """The cache's dtype is in the graphs (the KV tensors they read and write): a narrower cache is compiled
    again; auto leaves the key as it was before the field existed."""
    from spyre_operator.kinds.compile_job import cache_key

    s = OperatorSettings()
    key = cache_key(spec_of(graphCache={"precompile": True}), s)
    assert cache_key(spec_of(graphCache={"precompile": True}, kvCacheDtype="auto"), s) == key
    narrow = cache_key(spec_of(graphCache={"precompile": True}, kvCacheDtype="bfloat16"), s)
    assert narrow != key != cache_key(spec_of(graphCache={"precompile": True}, kvCacheDtype="float16"), s)
    # the model's own dtype named is auto: float32 under dtype float32, float16 on Spyre cards
    f32 = {"graphCache": {"precompile": True}, "dtype": "float32"}
    assert cache_key(spec_of(**f32, kvCacheDtype="float32"), s) == cache_key(spec_of(**f32), s)
    cards = {"graphCache": {"precompile": True}, "backend": "sendnn"}
    assert cache_key(spec_of(**cards, kvCacheDtype="float16"), s) == cache_key(spec_of(**cards), s)


def test_a_model_dtype_is_a_compile_configuration_of_its_own():
    """spec.dtype is in the graphs (their weights and activations): bfloat16 or float32 named is compiled
    again; auto, and float16 on Spyre cards (what auto runs there), leave the key as it was."""
    from spyre_operator.kinds.compile_job import cache_key

    s = OperatorSettings()
    pre = {"graphCache": {"precompile": True}}
    key = cache_key(spec_of(**pre), s)
    assert cache_key(spec_of(**pre, dtype="auto"), s) == key
    keys = {cache_key(spec_of(**pre, dtype=d), s) for d in ("bfloat16", "float16", "float32")}
    assert len(keys) == 3 and key not in keys
    cards = {**pre, "backend": "sendnn"}
    on_cards = cache_key(spec_of(**cards), s)
    assert cache_key(spec_of(**cards, dtype="float16"), s) == on_cards
    assert cache_key(spec_of(**cards, dtype="bfloat16"), s) != on_cards


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
