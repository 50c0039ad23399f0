"""--kv-cache-dtype (SENDNN_INFERENCE_KV_CACHE_DTYPE): a KV cache narrower than the model. The setting's
order and errors, the memory plan that sizes the cache by it, Spyre's refusal, and a float32 model on a
bfloat16 cache: its steps (prefill, decode, mixed) against the same model on a float32 cache. SmolLM2's greedy
parity with HF on a bfloat16 cache is in tests/runtime/test_smollm2.py."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from spyre_contract import DTYPES
from spyre_runtime.config import ConfigError, check_memory, load_config
from spyre_runtime.executor.model_executor import ModelExecutor
from spyre_runtime.steps import ContinuousStep, DecodeRow, PrefillChunk

from tests.runtime.executor.test_hot_path import small_cb

CB = {"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_USE_CB": "1"}


def test_the_setting_comes_from_the_flag_then_the_environment_then_auto(tiny_model):
    assert load_config(tiny_model, environ={}).kv_cache_dtype == "auto"
    env = {"SENDNN_INFERENCE_KV_CACHE_DTYPE": "bfloat16"}
    assert load_config(tiny_model, environ=env).kv_cache_dtype == "bfloat16"
    assert load_config(tiny_model, environ=env, kv_cache_dtype="float16").kv_cache_dtype == "float16"


@pytest.mark.parametrize(
    ("environ", "flag", "named"),
    [
        ({"SENDNN_INFERENCE_KV_CACHE_DTYPE": "fp8_e5m2"}, None, "SENDNN_INFERENCE_KV_CACHE_DTYPE='fp8_e5m2'"),
        ({}, "int8", "--kv-cache-dtype='int8'"),
    ],
)
def test_an_unknown_value_is_refused_naming_the_setting(tiny_model, environ, flag, named):
    with pytest.raises(ConfigError, match=named):
        load_config(tiny_model, environ=environ, kv_cache_dtype=flag)


KV = "SENDNN_INFERENCE_KV_CACHE_DTYPE"
SPYRE_REFUSAL = "(--kv-cache-dtype, SENDNN_INFERENCE_KV_CACHE_DTYPE, spec.kvCacheDtype): Spyre cards"


@pytest.mark.parametrize(
    ("environ", "args", "named"),
    [
        ({}, ["--kv-cache-dtype", "int8"], "--kv-cache-dtype='int8'"),
        ({KV: "int8"}, [], "SENDNN_INFERENCE_KV_CACHE_DTYPE='int8'"),
        ({}, ["--dtype", "bfloat16", "--kv-cache-dtype", "float16"], "under a bfloat16 model"),
        ({KV: "float16"}, ["--dtype", "bfloat16"], "under a bfloat16 model"),  # the environment's route
        ({KV: "float16", "SENDNN_INFERENCE_DTYPE": "bfloat16"}, [], "under a bfloat16 model"),
        ({"SENDNN_INFERENCE_DYNAMO_BACKEND": "sendnn"}, ["--kv-cache-dtype", "bfloat16"], SPYRE_REFUSAL),
        ({"SENDNN_INFERENCE_DYNAMO_BACKEND": "sendnn", KV: "bfloat16"}, [], SPYRE_REFUSAL),
        ({}, ["--task", "embed", "--kv-cache-dtype", "bfloat16"], "has no effect on a pooling model"),
        ({KV: "bfloat16"}, ["--task", "embed"], "SENDNN_INFERENCE_KV_CACHE_DTYPE='bfloat16' has no effect"),
    ],
)
def test_the_cli_stops_with_one_line_and_exit_code_2(tiny_model, tmp_path, environ, args, named):
    """Before anything loads: a bad value, and a pairing the runtime refuses (the memory plan's check),
    given by flag or by the environment alike; the refusal is stderr's last line and nothing is compiled."""
    cache = {"TORCH_SENDNN_CACHE_ENABLE": "1", "TORCH_SENDNN_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "spyre_runtime.cli", "compile", str(tiny_model), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor", **cache, **environ},
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert named in out.stderr.strip().splitlines()[-1] and "Traceback" not in out.stderr
    assert out.stdout == "" and not any(tmp_path.iterdir()), out.stdout


def test_spyre_cards_keep_the_model_s_dtype(tiny_model):
    env = {"SENDNN_INFERENCE_KV_CACHE_DTYPE": "bfloat16"}
    with pytest.raises(ConfigError, match=r"Spyre cards .* KV cache in the model's float16; set auto"):
        check_memory(load_config(tiny_model, environ=env), environ=env)
    check_memory(load_config(tiny_model, environ={"SENDNN_INFERENCE_KV_CACHE_DTYPE": "float16"}), environ={})


def test_only_a_float32_model_narrows_its_cache(tiny_model):
    """A bfloat16 model's float16 cache (or a wider one) would leave the kernels for the ATen ops, and fp16
    overflows where bf16 does not: refused at start-up, and by the executor for callers that skip it."""
    with pytest.raises(ConfigError, match="under a bfloat16 model: only a float32 model takes a narrower"):
        config = load_config(tiny_model, environ=CB, dtype="bfloat16", kv_cache_dtype="float16")
        check_memory(config, environ=CB)
    with pytest.raises(ConfigError, match=r"a float32 KV cache .* under a bfloat16 model"):
        ModelExecutor(small_cb(tiny_model, dtype="bfloat16", kv_cache_dtype="float32"))
    with pytest.raises(ConfigError, match="Spyre cards"):
        ModelExecutor(small_cb(tiny_model, backend="sendnn", kv_cache_dtype="bfloat16"), compile_only=True)


def test_the_graph_cache_keys_the_cache_s_dtype(tiny_model):
    """Graphs compiled for one cache dtype are not a hit for another; at auto the key is what it was."""
    from spyre_runtime.executor.graph_key import cache_configuration, cache_key

    base = small_cb(tiny_model)
    keys = {kv: cache_key(cache_configuration(dataclasses.replace(base, kv_cache_dtype=kv))) for kv in DTYPES}
    assert len(set(keys.values())) == 4
    assert "kv_cache_dtype" not in cache_configuration(base)


def test_the_memory_plan_sizes_a_bfloat16_cache_at_half_the_bytes(tiny_model):
    """With --memory-utilization the cache fills what is left: a bfloat16 cache of a float32 model gets
    twice the blocks; the plan's KV line halves for the same blocks."""
    base = dataclasses.replace(load_config(tiny_model, environ=CB), memory_utilization=0.05)
    wide = check_memory(base, environ=CB)
    narrow = check_memory(dataclasses.replace(base, kv_cache_dtype="bfloat16"), environ=CB)
    assert wide.num_kv_blocks > 10
    assert narrow.num_kv_blocks in (2 * wide.num_kv_blocks, 2 * wide.num_kv_blocks + 1)


def test_a_float32_model_on_a_bfloat16_cache_computes_what_a_float32_cache_does(tiny_model):
    """Every step kind (a prompt's chunks, decode, a mixed step) writes the cache narrowed and reads it
    through the kernels widened to float32: the logits stay within bfloat16's rounding of K and V of the
    float32 cache's, and the greedy tokens agree."""
    small = {"max_num_seqs": 4, "decode_batch_buckets": (4,), "kv_len_buckets": (128,)}
    wide = ModelExecutor(small_cb(tiny_model, **small))
    narrow = ModelExecutor(small_cb(tiny_model, kv_cache_dtype="bfloat16", **small), model=wide.model)
    assert all(k.dtype == v.dtype == torch.float32 for k, v in wide.kv.layers)
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in narrow.kv.layers)
    kv = wide.inputs.prefill_kv_len
    a = PrefillChunk(None, tuple(range(5, 15)), 0, 64, (1,), True)
    c_prompt = tuple(range(60, 100))
    decode = ContinuousStep(decode=(DecodeRow(None, 7, 10, (1,)),), batch_size=4, kv_len=128)
    c = PrefillChunk(None, c_prompt[25:], 25, 64, (4,), True)
    b = PrefillChunk(None, tuple(range(30, 42)), 0, 64, (3,), False)
    steps = [
        ("chunk", a, kv),
        ("chunk", PrefillChunk(None, c_prompt[:25], 0, 64, (4,), False), kv),
        ("batch_decode", decode),
        ("mixed", dataclasses.replace(decode, chunks=(c, b), mixed=True, pieces=4)),
    ]
    for kind, *step in steps:
        got = [ex.run_local(*getattr(ex.inputs, kind)(*step)) for ex in (wide, narrow)]
        assert got[1].dtype == torch.float32 and torch.isfinite(got[1]).all()
        assert (got[1] - got[0]).abs().max().item() <= 0.02 * got[0].abs().max().item(), kind
        assert torch.equal(got[1].argmax(-1), got[0].argmax(-1)), kind
    # the first layer's K and V (the same input in both) are the wide cache's, rounded to bfloat16; later
    # layers' inputs carry the rounding of the layers before
    (k, v), (k0, v0) = narrow.kv.layers[0], wide.kv.layers[0]
    assert torch.equal(k, k0.bfloat16()) and torch.equal(v, v0.bfloat16()) and k.abs().sum() > 0
