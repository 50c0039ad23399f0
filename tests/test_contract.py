"""The environment contract (spyre_contract), pure: bucket ranges with Gaudi's ramp-up rule (its documented
examples as rows), lists and ranges exclusive, the older backend spelling, the rules that tie variables to
flags. The runtime reads its settings with these rules and the operator checks pods with them."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from spyre_contract import ContractError, EngineFlags, expand_range, read_environment


@pytest.mark.parametrize(
    ("bmin", "step", "bmax", "expected"),
    [
        # Gaudi's documented examples: batch sizes 1,32,64; prompt lengths 128,128,512
        (1, 32, 64, (1, 2, 4, 8, 16, 32, 64)),
        (128, 128, 512, (128, 256, 384, 512)),
        (2, 32, 64, (2, 4, 8, 16, 32, 64)),
        (1, 4, 16, (1, 2, 4, 8, 12, 16)),
        (64, 128, 384, (64, 128, 256, 384)),
        (4, 4, 4, (4,)),
    ],
)
def test_expand_range_ramps_up_in_powers_of_two_then_steps(bmin, step, bmax, expected):
    assert expand_range(bmin, step, bmax) == expected


CB = {"SENDNN_INFERENCE_USE_CB": "1"}
FLAGS = EngineFlags(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256)


def test_ranges_reach_the_engine_menu():
    s = read_environment(
        {
            **CB,
            "SENDNN_INFERENCE_CB_DECODE_BATCH_BUCKETS": "1,4,8",
            "SENDNN_INFERENCE_CB_KV_BUCKETS": "128,128,512",
            "SENDNN_INFERENCE_CB_PREFILL_BUCKETS": "64,128,256",
        },
        FLAGS,
    )
    assert s.decode_batch_buckets == (1, 2, 4, 8)
    assert s.kv_len_buckets == (128, 256, 384, 512)
    assert s.prefill_buckets == (64, 128, 256)


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        (
            {"SENDNN_INFERENCE_CB_KV_BUCKETS": "64,128,512", "SENDNN_INFERENCE_CB_KV_LENS": "512"},
            "exclude each other",
        ),
        ({"SENDNN_INFERENCE_CB_KV_BUCKETS": "64,512"}, "must be min,step,max"),
        ({"SENDNN_INFERENCE_CB_KV_BUCKETS": "512,64,128"}, "min 512 is above max 128"),
        ({"SENDNN_INFERENCE_CB_KV_BUCKETS": "100,100,500"}, "not a multiple of 64"),
        ({"SENDNN_INFERENCE_CB_KV_BUCKETS": "64,64,256"}, "below --max-model-len=512"),
        ({"SENDNN_INFERENCE_CB_DECODE_BATCH_BUCKETS": "1,2,4"}, "below --max-num-seqs=8"),
        ({"SENDNN_INFERENCE_CB_PREFILL_BUCKETS": "64,64,128"}, "below --max-num-batched-tokens=256"),
        ({"SENDNN_INFERENCE_DYNAMO_BACKEND": "cuda"}, "SENDNN_INFERENCE_DYNAMO_BACKEND='cuda'"),
        ({"SENDNN_INFERENCE_DTYPE": "int4"}, "SENDNN_INFERENCE_DTYPE='int4'"),
    ],
)
def test_bad_settings_name_the_variable(env, needle):
    with pytest.raises(ContractError, match=None) as err:
        read_environment({**CB, **env}, FLAGS)
    assert needle in str(err.value)


# A step's chunk holds pieces of several prompts (SENDNN_INFERENCE_CB_PREFILL_PIECES, 4 by default, or
# --max-num-seqs when fewer; one without interleaved steps): a chunk is refused only when that many prompts of
# --max-model-len could not fill it. (environment, max_num_seqs, chunk, the prompts that fill a step or None)
CHUNK_LIMITS = [
    ({}, 8, 512, None),  # 4 prompts of 128
    ({}, 8, 576, 4),
    ({}, 2, 256, None),
    ({}, 2, 320, 2),  # fewer sequences than pieces
    ({"SENDNN_INFERENCE_CB_PREFILL_PIECES": "1"}, 8, 128, None),
    ({"SENDNN_INFERENCE_CB_PREFILL_PIECES": "1"}, 8, 192, 1),
    ({"SENDNN_INFERENCE_CB_PREFILL_PIECES": "16"}, 32, 2048, None),
    ({"SENDNN_INFERENCE_CP_INTERLEAVE_STEPS": "0"}, 8, 192, 1),  # chunks run alone: one prompt each
]


@pytest.mark.parametrize(("env", "seqs", "chunk", "fillers"), CHUNK_LIMITS)
def test_a_chunk_is_refused_only_when_a_steps_prompts_cannot_fill_it(env, seqs, chunk, fillers):
    flags = EngineFlags(max_model_len=100, max_num_seqs=seqs, max_num_batched_tokens=chunk)
    if fillers is None:
        assert read_environment({**CB, **env}, flags).max_num_batched_tokens == chunk
        return
    with pytest.raises(ContractError) as err:
        read_environment({**CB, **env}, flags)
    assert (
        f"--max-num-batched-tokens={chunk} is larger than {fillers} prompt(s) of --max-model-len=100 "
        in str(err.value)
    )
    assert "(rounded up to 128;" in str(err.value)


def test_a_chunk_is_checked_only_when_asked_for():
    assert read_environment(CB, EngineFlags(max_model_len=64, max_num_seqs=1)).max_num_batched_tokens == 256


def test_older_backend_spelling_is_an_alias_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        s = read_environment({"SENDNN_INFERENCE_DYNAMO_BACKEND": "sendnn_decoder"})
    assert s.backend == "sendnn"
    assert any("sendnn_decoder is deprecated" in r.getMessage() for r in caplog.records)
    assert s.deprecated_env == ("SENDNN_INFERENCE_DYNAMO_BACKEND=sendnn_decoder",)


@pytest.mark.parametrize(
    ("environ", "line"),
    [
        (
            {"VLLM_SPYRE_DYNAMO_BACKEND": "eager"},
            "VLLM_SPYRE_DYNAMO_BACKEND is no longer read (sendnn-inference 2.x renamed it): "
            "use SENDNN_INFERENCE_DYNAMO_BACKEND",
        ),
        (
            {"VLLM_SPYRE_USE_CB": "1"},
            "VLLM_SPYRE_USE_CB is no longer read (sendnn-inference 2.x renamed it): "
            "use SENDNN_INFERENCE_USE_CB",
        ),
        (
            {"VLLM_DT_CHUNK_LEN": "1024"},
            "VLLM_DT_CHUNK_LEN is gone in sendnn-inference 2.x: the prefill chunk is "
            "--max-num-batched-tokens (a multiple of 64)",
        ),
        (
            {"SENDNN_INFERENCE_USE_CHUNKED_PREFILL": "1"},
            "SENDNN_INFERENCE_USE_CHUNKED_PREFILL is gone in sendnn-inference 2.x: "
            "continuous batching always prefills in chunks of --max-num-batched-tokens; remove it",
        ),
    ],
)
def test_variables_sendnn_inference_2_renamed_or_removed_are_refused_in_one_line(environ, line):
    with pytest.raises(ContractError) as e:
        read_environment({"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", **environ})
    assert str(e.value) == line


def test_every_retired_variable_is_named_in_one_error():
    with pytest.raises(ContractError) as e:
        read_environment({"VLLM_SPYRE_DYNAMO_BACKEND": "eager", "VLLM_DT_CHUNK_LEN": "64"})
    assert str(e.value).count("; ") == 1 and "\n" not in str(e.value)
    assert "VLLM_DT_CHUNK_LEN" in str(e.value) and "VLLM_SPYRE_DYNAMO_BACKEND" in str(e.value)


SMOLLM2 = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
GRANITE_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 12800,
    "vocab_size": 49155,
}


@pytest.mark.parametrize(
    ("model", "env", "flags", "dtype_bytes", "card_gib", "weights_gib", "fits"),
    [
        # SmolLM2-135M: 134.5 M parameters, 0.50 GiB in fp32
        (SMOLLM2, {}, EngineFlags(), 4, 128, 0.50, True),
        (SMOLLM2, {}, EngineFlags(), 2, 128, 0.25, True),
        (SMOLLM2, {}, EngineFlags(), 4, 0.25, 0.50, False),
        # granite-8b-class: 8.2 G parameters; 15.3 GiB in fp16 on one card, 3.8 GiB a rank on four
        (GRANITE_8B, {}, EngineFlags(), 2, 128, 15.3, True),
        (GRANITE_8B, {}, EngineFlags(tensor_parallel_size=4), 2, 128, 3.8, True),
        (GRANITE_8B, {}, EngineFlags(), 4, 16, 30.6, False),
        # continuous batching: the KV pool of 256 sequences of 32k tokens does not fit one card
        (GRANITE_8B, CB, EngineFlags(max_num_seqs=256, max_model_len=32768), 2, 128, 15.3, False),
    ],
)
def test_memory_plan_table(model, env, flags, dtype_bytes, card_gib, weights_gib, fits):
    from spyre_contract.memory import GIB, ModelDims, plan_memory

    plan = plan_memory(
        ModelDims.from_config(model), read_environment(env, flags), int(card_gib * GIB), "card", dtype_bytes
    )
    assert abs(plan.weights / GIB - weights_gib) < 0.05 * weights_gib + 0.01
    assert plan.fits is fits
    if not fits:
        line = plan.refusal()
        assert "\n" not in line and "the largest consumer is the" in line and "GiB" in line


def test_memory_plan_names_the_kv_cache_and_what_would_fit():
    from spyre_contract.memory import GIB, ModelDims, plan_memory

    settings = read_environment(CB, EngineFlags(max_num_seqs=256, max_model_len=32768))
    plan = plan_memory(ModelDims.from_config(GRANITE_8B), settings, 128 * GIB, "card", 2)
    assert plan.kv_cache > plan.weights
    assert "largest consumer is the KV cache" in plan.refusal() and "fewer sequences" in plan.refusal()


def test_serve_stops_before_loading_when_the_plan_cannot_fit(tmp_path):
    import os
    import subprocess
    import sys

    from spyre_runtime.testing.models import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    env = {
        **os.environ,
        "SENDNN_INFERENCE_DYNAMO_BACKEND": "sendnn",
        "SENDNN_INFERENCE_CARD_MEMORY_GIB": "0.000001",
    }
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    res = subprocess.run(
        [sys.executable, "-m", "spyre_runtime.cli", "generate", str(model), "--prompts", str(prompts)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "the memory plan does not fit" in errors[0]


def test_memory_utilization_sizes_the_kv_cache_from_the_memory_left(tmp_path, caplog):
    import json

    from spyre_runtime.config import check_memory, load_config

    (tmp_path / "config.json").write_text(json.dumps({**SMOLLM2, "torch_dtype": "float32"}))
    env = {"SENDNN_INFERENCE_DYNAMO_BACKEND": "sendnn", "SENDNN_INFERENCE_USE_CB": "1"}
    config = load_config(tmp_path, env, max_num_seqs=4, max_model_len=256, dtype="float32")
    caplog.set_level(logging.INFO)
    sized = check_memory(
        dataclasses.replace(config, memory_utilization=0.5), {"SENDNN_INFERENCE_CARD_MEMORY_GIB": "2"}
    )
    # 1 GiB of a 2 GiB card, less 0.50 GiB of weights: ~0.5 GiB of 64-token blocks of 30 layers x 3 KV heads
    per_block = 64 * 2 * 30 * 3 * 64 * 4
    assert (
        abs(sized.num_kv_blocks - (0.5 * 2**31 - 134_515_008 * 4) // per_block) < 0.03 * sized.num_kv_blocks
    )
    assert sized.num_kv_blocks > config.cb_num_blocks
    assert any("KV cache blocks" in r.getMessage() for r in caplog.records)
    fixed = dataclasses.replace(config, memory_utilization=0.5, num_kv_blocks=9)
    assert check_memory(fixed, {"SENDNN_INFERENCE_CARD_MEMORY_GIB": "2"}).num_kv_blocks == 9
    assert (
        check_memory(config, {"SENDNN_INFERENCE_CARD_MEMORY_GIB": "2"}).num_kv_blocks == 0
    )  # off by default


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_the_memory_plan_reads_the_checkpoints_dtype_by_either_name(tmp_path, key):
    """--dtype auto on CPU plans the checkpoint's own dtype, whether config.json names it `dtype`
    (transformers >= 4.56 writes that) or `torch_dtype`, as the executor loads it: a bfloat16 checkpoint's KV
    blocks are half a float32 one's, so --memory-utilization sizes more than twice as many."""
    import json

    from spyre_runtime.config import check_memory, load_config

    def blocks(named: dict) -> int:
        (tmp_path / "config.json").write_text(json.dumps({**SMOLLM2, **named}))
        env = {"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_USE_CB": "1"}
        config = load_config(tmp_path, env, max_num_seqs=4, max_model_len=256, dtype="auto")
        return check_memory(dataclasses.replace(config, memory_utilization=0.5)).num_kv_blocks

    # half the bytes a block, and the weights take half as much of the memory first: a little over twice
    float32, bfloat16 = blocks({key: "float32"}), blocks({key: "bfloat16"})
    assert float32 > 100 and 2 * float32 <= bfloat16 <= 3 * float32, (float32, bfloat16)


@pytest.mark.parametrize(
    ("backend", "dtype_bytes", "seqs", "env", "routing", "packed", "panels"),
    [
        ("inductor", 4, 8, {}, "packed", True, True),
        ("eager", 4, 8, {}, "packed", True, True),
        ("inductor", 2, 8, {}, "packed", True, True),
        ("inductor", 4, 1, {}, "packed", True, True),
        ("inductor", 4, 8, {"SENDNN_INFERENCE_ROW_LINEAR": "0"}, "packed", True, False),
        ("inductor", 2, 8, {"SENDNN_INFERENCE_PAGED_ATTENTION_KERNEL": "off"}, "packed", True, False),
        # bfloat16 where oneDNN packs none: the op runs on the plain weight, the row linear on its panels
        ("inductor", 2, 8, {}, "plain", False, True),
        ("eager", 2, 1, {"SENDNN_INFERENCE_ROW_LINEAR": "0"}, "plain", False, False),
        ("inductor", 2, 8, {}, "none", False, False),  # float16: ATen's GEMM on the plain weight
        ("sendnn", 4, 8, {}, "packed", False, False),
        ("sendnn", 2, 1, {}, "plain", False, False),
    ],
)
def test_memory_plan_counts_the_cpu_decode_weights_packed_again_and_in_panels(
    backend, dtype_bytes, seqs, env, routing, packed, panels
):
    """Decoders on CPU backends run their linear layers on a second copy of the weights, packed for oneDNN
    (whatever the batch) where it packs the dtype, and, with the C++ extension and its row linear on, steps
    of a few rows on a further copy, in panels: the plan counts each (a row of its own, in the total);
    Spyre's compiler packs its own."""
    from spyre_contract.memory import GIB, ModelDims, plan_memory

    env = CB | env | {"SENDNN_INFERENCE_DYNAMO_BACKEND": backend}
    settings = read_environment(env, EngineFlags(max_num_seqs=seqs, max_model_len=512))
    dims = ModelDims.from_config(SMOLLM2)
    plan = plan_memory(dims, settings, 128 * GIB, "host", dtype_bytes, routing=routing)
    assert plan.packed_weights == (plan.weights if packed else 0)
    assert plan.panel_weights == (plan.weights if panels else 0)
    assert plan.total == (
        plan.weights + plan.packed_weights + plan.panel_weights + plan.kv_cache + plan.activations
    )
    assert ("weights packed for oneDNN (CPU)" in plan.table()) is packed
    assert ("weights in panels for few rows (CPU)" in plan.table()) is panels


def test_memory_plan_refuses_a_routing_it_does_not_know():
    from spyre_contract.memory import GIB, ModelDims, plan_memory

    settings = read_environment(CB, EngineFlags(max_num_seqs=1, max_model_len=512))
    with pytest.raises(ValueError, match="routing 'packd' is not one of packed, plain, none"):
        plan_memory(ModelDims.from_config(SMOLLM2), settings, 128 * GIB, "host", 2, routing="packd")


def test_a_plan_too_large_for_its_weights_names_the_row_linears_copy_and_bad_switches_are_named():
    from spyre_contract.memory import ModelDims, plan_memory

    settings = read_environment(CB | {"SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor"})
    dims = ModelDims.from_config(SMOLLM2)
    tight = plan_memory(dims, settings, 1 << 20, "host")
    assert not tight.fits and "SENDNN_INFERENCE_ROW_LINEAR=0 (no copy in panels)" in tight.refusal()
    for name in ("SENDNN_INFERENCE_ROW_LINEAR", "SENDNN_INFERENCE_PAGED_ATTENTION_KERNEL"):
        with pytest.raises(ContractError, match=f"{name}='maybe' is not a boolean"):
            read_environment(CB | {name: "maybe"})
