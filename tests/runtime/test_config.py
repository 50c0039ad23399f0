"""Environment contract parsing: canonical names, deprecated aliases, flags winning, clear errors."""

import logging
import subprocess
import sys

import pytest
from spyre_runtime.config import ConfigError, Shape, load_config
from spyre_runtime.engine.sched.continuous import ContinuousScheduler
from spyre_runtime.engine.sched.factory import make_scheduler
from spyre_runtime.engine.sched.static import StaticScheduler


def test_defaults_and_zipped_shapes():
    cfg = load_config(
        "/models/m",
        environ={
            "SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor",
            "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "128, 64",
            "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "20,64",
            "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "4,1",
        },
    )
    assert cfg.backend == "inductor"
    assert cfg.shapes == (Shape(64, 64, 1), Shape(128, 20, 4))
    assert cfg.max_model_len == 148 and cfg.max_num_seqs == 4
    assert cfg.served_model_name == "m"
    assert load_config("/m", environ={}).backend == "sendnn"


def test_a_1x_alias_is_refused_naming_its_2x_name():
    with pytest.raises(
        ValueError, match=r"VLLM_SPYRE_USE_CB is no longer read .*: use SENDNN_INFERENCE_USE_CB"
    ):
        load_config("/m", environ={"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "VLLM_SPYRE_USE_CB": "1"})


def test_the_canonical_name_does_not_excuse_the_alias():
    env = {"VLLM_SPYRE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor"}
    with pytest.raises(ValueError, match="VLLM_SPYRE_DYNAMO_BACKEND is no longer read"):
        load_config("/m", environ=env)


def test_flags_win_over_environment():
    cfg = load_config("/m", environ={}, max_model_len=512, max_num_seqs=3, served_model_name="x", port=9000)
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.served_model_name, cfg.port) == (512, 3, "x", 9000)


STATIC_LINE = (
    "static batching over the warm-up shapes ({}): sendnn-inference 1.x's mode; 2.x runs decoders with "
    "continuous batching only (chunked prefill, prefix caching), as SENDNN_INFERENCE_USE_CB=1 or no batching "
    "setting does here"
)


def test_a_decoder_with_no_batching_setting_runs_continuous_batching(caplog):
    caplog.set_level(logging.INFO, logger="spyre_runtime.config")
    cfg = load_config("/m", environ={"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager"})
    assert cfg.use_cb and isinstance(make_scheduler(cfg), ContinuousScheduler)
    assert cfg.enable_prefix_caching  # prefix caching on
    assert (cfg.max_num_batched_tokens, cfg.chunk_buckets) == (256, (64, 128, 192, 256))  # chunked prefill
    assert (cfg.max_model_len, cfg.max_num_seqs) == (512, 4)
    same = {"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_USE_CB": "1"}
    assert load_config("/m", environ=same) == cfg  # the default is what USE_CB=1 asks for
    assert "1.x" not in caplog.text


@pytest.mark.parametrize("task", ["embed", "score", "rerank"])
def test_a_pooling_model_stays_on_static_shapes(task, caplog):
    caplog.set_level(logging.INFO, logger="spyre_runtime.config")
    cfg = load_config("/m", environ={}, task=task)
    assert not cfg.use_cb and cfg.shapes == (Shape(64, 0, 1),)
    assert (cfg.max_model_len, cfg.max_num_seqs) == (64, 1)
    assert "1.x" not in caplog.text  # static is their only mode, not a choice to name
    with pytest.raises(ConfigError, match="SENDNN_INFERENCE_USE_CB=1 applies to decoders"):
        load_config("/m", environ={"SENDNN_INFERENCE_USE_CB": "1"}, task=task)


@pytest.mark.parametrize(
    ("env", "chosen_by"),
    [
        ({"SENDNN_INFERENCE_USE_CB": "0"}, "SENDNN_INFERENCE_USE_CB=0"),
        ({"SENDNN_INFERENCE_USE_CB": " false "}, "SENDNN_INFERENCE_USE_CB=false"),
        (
            {"SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "20", "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "2"},
            "SENDNN_INFERENCE_WARMUP_NEW_TOKENS without SENDNN_INFERENCE_USE_CB",
        ),
    ],
    ids=["use-cb-0", "use-cb-false", "warm-up-shapes"],
)
def test_static_batching_is_a_decoder_s_explicit_choice_named_as_1x_s_mode(env, chosen_by, caplog):
    caplog.set_level(logging.INFO, logger="spyre_runtime.config")
    cfg = load_config("/m", environ=env)
    assert not cfg.use_cb and isinstance(make_scheduler(cfg), StaticScheduler)
    assert [r.getMessage() for r in caplog.records] == [STATIC_LINE.format(chosen_by)]


def test_warm_up_shapes_beside_use_cb_1_are_continuous_batching():
    env = {"SENDNN_INFERENCE_USE_CB": "1", "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "2"}
    assert load_config("/m", environ=env).use_cb


def test_serve_says_static_batching_is_1x_s_mode_in_one_line(tiny_model):
    env = {"SENDNN_INFERENCE_USE_CB": "0", "SENDNN_INFERENCE_DYNAMO_BACKEND": "sendnn"}
    res = run_cli("serve", str(tiny_model), "--port", "1", env=env)  # stops at the missing torch_sendnn
    said = [line for line in res.stderr.splitlines() if "1.x's mode" in line]
    assert len(said) == 1 and said[0].endswith(STATIC_LINE.format("SENDNN_INFERENCE_USE_CB=0"))


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SENDNN_INFERENCE_DYNAMO_BACKEND": "tpu"}, "SENDNN_INFERENCE_DYNAMO_BACKEND='tpu' is not one of"),
        (
            {"SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "100"},
            "SENDNN_INFERENCE_WARMUP_PROMPT_LENS: 100 is not a multiple of 64",
        ),
        ({"SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64,x"}, "'x' is not an integer"),
        (
            {"SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "0"},
            "SENDNN_INFERENCE_WARMUP_NEW_TOKENS='0': 0 must be positive",
        ),
        (
            {"SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "-2"},
            "SENDNN_INFERENCE_WARMUP_BATCH_SIZES='-2': -2 must be positive",
        ),
        (
            {"SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64,128", "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "20"},
            "warmup lists differ in length",
        ),
        ({"SENDNN_INFERENCE_USE_CB": "maybe"}, "SENDNN_INFERENCE_USE_CB='maybe' is not a boolean"),
        (
            {"SENDNN_INFERENCE_MAX_LOAD_PROCESSES": "-1"},
            "SENDNN_INFERENCE_MAX_LOAD_PROCESSES='-1' must be >= 0",
        ),
        (
            {"SENDNN_INFERENCE_CB_MIXED_PREFILL_TOKENS": "-8"},
            "SENDNN_INFERENCE_CB_MIXED_PREFILL_TOKENS='-8' must be >= 0",
        ),
        (
            {"SENDNN_INFERENCE_CB_PREFILL_PIECES": "0"},
            "SENDNN_INFERENCE_CB_PREFILL_PIECES='0' must be >= 1",
        ),
        (
            {"SENDNN_INFERENCE_CB_MIXED_PREFILL_TOKENS": "half"},
            "SENDNN_INFERENCE_CB_MIXED_PREFILL_TOKENS='half' is not an integer",
        ),
        (
            {"SENDNN_INFERENCE_CB_WAVE_START": "later"},
            "SENDNN_INFERENCE_CB_WAVE_START='later' is not a boolean (use 1 or 0)",
        ),
        (
            {"SENDNN_INFERENCE_CB_NGRAM_SPEC_TOKENS": "-1"},
            "SENDNN_INFERENCE_CB_NGRAM_SPEC_TOKENS='-1' must be >= 0",
        ),
        (
            {"SENDNN_INFERENCE_CB_NGRAM_SPEC_TOKENS": "three"},
            "SENDNN_INFERENCE_CB_NGRAM_SPEC_TOKENS='three' is not an integer",
        ),
        (
            {"SENDNN_INFERENCE_CB_STEP_BUDGET_MS": "-5"},
            "SENDNN_INFERENCE_CB_STEP_BUDGET_MS='-5' must be >= 0",
        ),
        (
            {"SENDNN_INFERENCE_CB_STEP_COST_US": "34000,900"},
            "SENDNN_INFERENCE_CB_STEP_COST_US needs 3 integers: fixed,per-token,per-row microseconds, not 2",
        ),
        (
            {"SENDNN_INFERENCE_CB_STEP_COST_US": "34000,0.9,2600"},
            "SENDNN_INFERENCE_CB_STEP_COST_US='34000,0.9,2600': '0.9' is not an integer",
        ),
        ({"TORCH_SENDNN_CACHE_ENABLE": "1"}, "TORCH_SENDNN_CACHE_ENABLE=1 needs TORCH_SENDNN_CACHE_DIR"),
        ({"SENDNN_INFERENCE_ROW_LINEAR": "2"}, "SENDNN_INFERENCE_ROW_LINEAR='2' is not a boolean"),
        (
            {"SENDNN_INFERENCE_PAGED_ATTENTION_KERNEL": "auto"},
            "SENDNN_INFERENCE_PAGED_ATTENTION_KERNEL='auto' is not a boolean",
        ),
    ],
)
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("/m", environ=env)


def run_cli(*args, env=None):
    import os

    return subprocess.run(
        [sys.executable, "-m", "spyre_runtime.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_bad_env_stops_serve_with_one_line_and_exit_2(tiny_model):
    res = run_cli("serve", str(tiny_model), env={"SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "65"})
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "spyre-runtime: error: SENDNN_INFERENCE_WARMUP_PROMPT_LENS: 65 is not a multiple of 64"
    )
    assert "Traceback" not in res.stderr


def test_a_variable_2x_removed_stops_serve_with_one_line_naming_its_replacement(tiny_model):
    res = run_cli("serve", str(tiny_model), env={"VLLM_DT_CHUNK_LEN": "128"})
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "spyre-runtime: error: VLLM_DT_CHUNK_LEN is gone in sendnn-inference 2.x: the prefill chunk is "
        "--max-num-batched-tokens (a multiple of 64)"
    )


def test_missing_sendnn_names_cpu_backends(tiny_model):
    res = run_cli("serve", str(tiny_model), env={"SENDNN_INFERENCE_DYNAMO_BACKEND": "sendnn"})
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch_sendnn" in lines[0] and "inductor or eager" in lines[0]


def test_bad_flag_is_rejected(tiny_model):
    res = run_cli("serve", str(tiny_model), "--port", "0")
    assert res.returncode == 2 and "--port: 0 must be positive" in res.stderr


def test_continuous_batching_limits_and_buckets():
    cfg = load_config("/m", environ={"SENDNN_INFERENCE_USE_CB": "1"})
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens) == (512, 4, 256)
    assert cfg.chunk_buckets == (64, 128, 192, 256)
    assert cfg.batch_buckets == (1, 2, 4)
    assert cfg.kv_buckets == (64, 128, 256, 512)
    assert cfg.cb_num_blocks == 1 + 4 * 8 and cfg.enable_prefix_caching
    env = {
        "SENDNN_INFERENCE_USE_CB": "1",
        "SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES": "8,2",
        "SENDNN_INFERENCE_CB_KV_LENS": "384,128",
    }
    cfg = load_config("/m", environ=env, max_num_seqs=6, max_model_len=300, max_num_batched_tokens=192)
    assert (cfg.batch_buckets, cfg.kv_buckets, cfg.chunk_buckets) == ((2, 8), (128, 384), (64, 128, 192))
    assert not load_config(
        "/m", environ=env, max_model_len=384, enable_prefix_caching=False
    ).enable_prefix_caching


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        ({}, {"max_num_batched_tokens": 100}, "--max-num-batched-tokens=100 is not a multiple of 64"),
        ({}, {"max_model_len": 256, "num_kv_blocks": 4}, "--num-kv-blocks=4 cannot hold one sequence"),
        (
            {"SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES": "1,2"},
            {"max_num_seqs": 4},
            "SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES: the largest bucket 2 is below --max-num-seqs=4",
        ),
        (
            {"SENDNN_INFERENCE_CB_KV_LENS": "100"},
            {},
            "SENDNN_INFERENCE_CB_KV_LENS: 100 is not a multiple of 64",
        ),
        (
            {"SENDNN_INFERENCE_CB_KV_LENS": "128"},
            {"max_model_len": 200},
            "SENDNN_INFERENCE_CB_KV_LENS: the largest bucket 128 is below --max-model-len=200",
        ),
    ],
)
def test_bad_continuous_batching_settings_name_the_setting(env, flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config("/m", environ={"SENDNN_INFERENCE_USE_CB": "1", **env}, **flags)


def test_bad_chunk_flag_stops_serve_with_one_line(tiny_model):
    res = run_cli(
        "serve", str(tiny_model), "--max-num-batched-tokens", "100", env={"SENDNN_INFERENCE_USE_CB": "1"}
    )
    assert res.returncode == 2
    assert res.stderr.strip() == "spyre-runtime: error: --max-num-batched-tokens=100 is not a multiple of 64"
