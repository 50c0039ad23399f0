"""The serving hot path: --dtype (flag, environment, checkpoint default), linear layers on weights packed at
warm-up (no inductor freezing for fp32 CPU decoders), paged decode attention, mixed steps, one whole graph per
bucket (no graph break)."""

import dataclasses
import gc
import json
import os
import subprocess
import sys

import pytest
import torch
from spyre_runtime.config import ConfigError, RuntimeConfig, load_config
from spyre_runtime.executor.loader import resolve_dtype
from spyre_runtime.executor.model_executor import ModelExecutor, mixed_live_rows
from spyre_runtime.steps import ContinuousStep, DecodeRow, PrefillChunk


def small_cb(model_dir, backend: str = "eager", **kw) -> RuntimeConfig:
    """Continuous batching of 2 sequences of up to 128 tokens, chunks of 64."""
    base = {"max_model_len": 128, "max_num_seqs": 2, "max_num_batched_tokens": 64}
    return RuntimeConfig(
        model_dir=model_dir, served_model_name="t", backend=backend, use_cb=True, **(base | kw)
    )


def test_dtype_comes_from_flag_then_environment_then_auto(tiny_model):
    assert load_config(tiny_model, environ={}).dtype == "auto"
    assert load_config(tiny_model, environ={"SENDNN_INFERENCE_DTYPE": "bfloat16"}).dtype == "bfloat16"
    assert load_config(tiny_model, environ={"SENDNN_INFERENCE_DTYPE": "bfloat16"}, dtype="float16").dtype == (
        "float16"
    )


@pytest.mark.parametrize(
    ("environ", "flag", "named"),
    [({"SENDNN_INFERENCE_DTYPE": "fp8"}, None, "SENDNN_INFERENCE_DTYPE"), ({}, "double", "--dtype")],
)
def test_unknown_dtype_is_refused_naming_the_setting(tiny_model, environ, flag, named):
    with pytest.raises(ConfigError, match=named):
        load_config(tiny_model, environ=environ, dtype=flag)


def test_cli_refuses_unknown_dtype_before_loading(tiny_model):
    out = subprocess.run(
        [sys.executable, "-m", "spyre_runtime.cli", "compile", str(tiny_model), "--dtype", "half-ish"],
        capture_output=True,
        text=True,
        env={"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert out.returncode == 2
    assert "--dtype='half-ish'" in out.stderr


def test_auto_dtype_is_the_checkpoints_on_cpu_and_float16_on_spyre(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert resolve_dtype("auto", "inductor", tmp_path) == torch.bfloat16
    assert resolve_dtype("auto", "sendnn", tmp_path) == torch.float16
    assert resolve_dtype("float32", "sendnn", tmp_path) == torch.float32
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert resolve_dtype("auto", "eager", tmp_path) == torch.float32


def test_bfloat16_weights_and_kv_cache(tiny_model):
    cfg = small_cb(tiny_model, dtype="bfloat16")
    ex = ModelExecutor(cfg)
    assert {p.dtype for p in ex.model.parameters()} == {torch.bfloat16}
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in ex.kv.layers)
    ex.warmup()
    logits = ex.run_local(*ex.inputs.batch_decode(ContinuousStep(batch_size=2, kv_len=128)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_decode_runs_on_weights_prepacked_at_warmup_in_one_graph_per_bucket(tiny_model):
    """fp32 on CPU: every linear layer runs through the packed-linear op (linear.py), which packs its weight
    for the decode batch size once, at warm-up. The weights stay graph inputs (no freezing), so changing them
    in place afterwards would change a graph that read them: the decode step does not change, because it runs
    on the packed copies (weights never change after warm-up). 17 live rows: a step of up to
    linear.row_limits() (32 in float32) runs the row linear, on its own copy of the weight in panels, made
    at load as oneDNN's packed one is."""
    from spyre_runtime.executor import compiler, linear
    from torch._dynamo.utils import counters

    counters.clear()
    cfg = small_cb(tiny_model, "inductor", max_num_seqs=32, decode_batch_buckets=(32,), kv_len_buckets=(128,))
    ex = ModelExecutor(cfg)
    # two blocks, each in its own call (at most MAX_BLOCK_CALLS): they share one graph per shape
    assert ex.blocks.group == 1 and len(compiler.repeated_blocks(ex.model)) == 2
    ex.warmup()
    # chunk 64 and decode batch 32, each one graph for both blocks (a graph per block would make 4)
    assert counters["stats"]["unique_graphs"] == len(cfg.chunk_buckets) + 1
    assert not counters["graph_break"]
    layers = [m for m in ex.model.modules() if isinstance(m, torch.nn.Linear)]
    assert ex.packed and len(layers) > 0
    assert all(m.weight.data_ptr() in linear._PACKED for m in layers)  # every layer packed at load
    rows = tuple(DecodeRow(None, 5 + r, 3, (1 + 2 * r, 2 + 2 * r)) for r in range(17))
    args = ex.inputs.batch_decode(ContinuousStep(decode=rows, batch_size=32, kv_len=128))
    before = ex.run_local(*args).clone()
    with torch.no_grad():
        for m in layers:
            m.weight.mul_(0.5)
    assert before.abs().sum() > 0
    assert torch.equal(ex.run_local(*args), before)  # the packed copies, no recompile
    # the groups' graph keeps its guards on the step's tensors (compiler.without_parameter_guards): a batch
    # that no graph was warmed for is still caught, and serving refuses to compile it
    odd = ex.inputs.batch_decode(ContinuousStep(batch_size=3, kv_len=128))
    with pytest.raises(RuntimeError, match="Detected recompile"):
        ex.run_local(*odd)
    with torch.inference_mode():
        halved = torch.nn.functional.linear(torch.ones(17, layers[0].in_features), layers[0].weight)
        packed = layers[0](torch.ones(17, layers[0].in_features))
    torch.testing.assert_close(packed, 2 * halved)  # (the op really serves the packed, unhalved weight)


def test_block_graphs_drop_only_the_guards_on_parameters():
    """The guards a group's graph keeps: everything (the step's tensors and arguments, the dynamic range,
    global state, module attributes) but the tensor guards on the blocks' parameters."""
    from types import SimpleNamespace

    from spyre_runtime.executor.compiler import without_parameter_guards

    def entry(guard_type, value=None):
        return SimpleNamespace(guard_type=guard_type, value=value)

    entries = [
        entry("TENSOR_MATCH", torch.zeros(2)),  # L['x'], a KV cache tensor
        entry("TENSOR_MATCH", torch.nn.Parameter(torch.zeros(2))),  # a block's weight
        entry("SHAPE_ENV"),
        entry("GLOBAL_STATE"),
        entry("EQUALS_MATCH", 128),  # a block's constant attribute, a non-tensor argument
        entry("TYPE_MATCH", torch.nn.Linear(2, 2)),
    ]
    assert without_parameter_guards(entries) == [True, False, True, True, True, True]


def test_block_groups_divide_the_stack_into_at_most_max_calls():
    from spyre_runtime.executor.compiler import block_group_size, repeated_blocks

    cases = {(30, 5): 6, (30, 1): 30, (30, 30): 1, (2, 5): 1, (2, 1): 2, (7, 5): 7, (32, 5): 8, (40, 5): 8}
    for (blocks, calls), group in cases.items():
        assert block_group_size(blocks, calls) == group, (blocks, calls)
    model = torch.nn.Sequential(
        torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.ReLU()]),  # mixed classes: not the stack
        torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)]),
        torch.nn.ModuleList([torch.nn.ReLU() for _ in range(2)]),
    )
    assert repeated_blocks(model) == list(model[1])
    from spyre_runtime.config import ConfigError
    from spyre_runtime.executor.compiler import BlockCompiler

    # a model with no stack of blocks (or one that does not match its KV layers) stops start-up, named
    with pytest.raises(ConfigError, match="Linear: no stack of decoder blocks"):
        BlockCompiler(torch.nn.Linear(2, 2), "inductor", [])
    with pytest.raises(ConfigError, match="no stack of decoder blocks"):
        BlockCompiler(model, "inductor", [None] * 2)  # 3 blocks, 2 KV layers


def test_a_decode_step_with_few_live_rows_multiplies_only_those(tiny_model):
    """One live row in a 4-row decode graph (compiled, serving stance): the packed-linear op multiplies that
    row alone (the dummy rows' logits come out exactly zero) and its logits equal the full step's; with every
    row live, every row is multiplied."""
    from spyre_runtime.executor import linear

    cfg = small_cb(tiny_model, "inductor", max_num_seqs=4, decode_batch_buckets=(4,), kv_len_buckets=(128,))
    ex = ModelExecutor(cfg)
    ex.warmup()
    step = ContinuousStep(decode=(DecodeRow(None, 9, 3, (2,)),), batch_size=4, kv_len=128)
    args = ex.inputs.batch_decode(step)
    args[0][1:, 0] = 5  # dummy rows of a token that does not embed to zeros (they write scratch only)
    full = ex.run_local(*args)
    few = ex.run_local(*args, live_rows=1)
    assert full[1:].abs().sum() > 0 and not few[1:].any()
    torch.testing.assert_close(few[0], full[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(ex.run_local(*args, live_rows=4), full)
    assert linear._live is None  # the hint ends with its step


def test_a_mixed_step_equals_its_decode_and_its_chunks_run_apart(tiny_model):
    """Chunked prefill beside the decode (one forward of the pieces of two prompts and the decode tokens)
    computes what a decode step and each piece's own prefill step compute: every piece's last-token logits
    (one piece continues a prompt with earlier context, one starts a prompt and does not end it) and every
    decode row's."""
    cfg = small_cb(tiny_model, max_num_seqs=4, decode_batch_buckets=(4,), kv_len_buckets=(128,))
    ex = ModelExecutor(cfg)
    kv = ex.inputs.prefill_kv_len
    assert cfg.prefill_pieces == 4
    # a: 10 prompt tokens in block 1, prefilled first; c: the first 25 of 40 tokens (block 4) likewise. Then
    # one mixed step: a decodes, c's last 15 tokens and b's first 12 of 20 (block 3) are prefilled
    a = PrefillChunk(None, tuple(range(5, 15)), 0, 64, (1,), True)
    c_prompt = tuple(range(60, 100))
    ex.run_local(*ex.inputs.chunk(a, kv))
    ex.run_local(*ex.inputs.chunk(PrefillChunk(None, c_prompt[:25], 0, 64, (4,), False), kv))
    saved = [(k.clone(), v.clone()) for k, v in ex.kv.layers]
    decode = ContinuousStep(decode=(DecodeRow(None, 7, 10, (1,)),), batch_size=4, kv_len=128)
    c = PrefillChunk(None, c_prompt[25:], 25, 64, (4,), True)
    b = PrefillChunk(None, tuple(range(30, 42)), 0, 64, (3,), False)
    apart = [ex.run_local(*ex.inputs.chunk(chunk, kv))[0] for chunk in (c, b)]
    apart.append(ex.run_local(*ex.inputs.batch_decode(decode))[0])
    for (k, v), (k0, v0) in zip(ex.kv.layers, saved, strict=True):
        k.copy_(k0)
        v.copy_(v0)
    mixed = ex.run_local(*ex.inputs.mixed(dataclasses.replace(decode, chunks=(c, b), mixed=True, pieces=4)))
    assert mixed.shape[0] == 8  # the 4 pieces' places (2 used), then the 4 decode rows (3 of them dummies)
    for row, expected in zip((0, 1, 4), apart, strict=True):
        torch.testing.assert_close(mixed[row], expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(mixed[0], mixed[1])
    # the dead decode rows are the step's last tokens and the unused piece places lie before the decode
    # rows: told so (mixed_live_rows), the GEMMs, the LM head and the paged decode skip them, and the live
    # rows' logits are the same
    for (k, v), (k0, v0) in zip(ex.kv.layers, saved, strict=True):
        k.copy_(k0)
        v.copy_(v0)
    step = dataclasses.replace(decode, chunks=(c, b), mixed=True, pieces=4)
    args = ex.inputs.mixed(step)
    total = args[0].shape[1]  # C + P + B: 64 + 4 + 4
    args[0][0, -3:] = 9  # dummy rows that are not the (zero) padding embedding: computed, they are not zero
    args[0][0, 66:68] = 9  # so are the unused piece places 2 and 3
    assert mixed_live_rows(args[0], step) == (total - 3, 1, {total: ((0, 66), (68, 69)), 8: ((0, 2), (4, 5))})
    assert ex.packed  # the GEMMs run in the packed op that reads the hint
    skipped = ex.run_local(*args, live_rows=mixed_live_rows(args[0], step))
    for (k, v), (k0, v0) in zip(ex.kv.layers, saved, strict=True):
        k.copy_(k0)
        v.copy_(v0)
    computed = ex.run_local(*args)
    live, dead = [0, 1, 4], [2, 3, 5, 6, 7]
    torch.testing.assert_close(skipped[live], mixed[live], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(computed[live], mixed[live], atol=1e-5, rtol=1e-5)
    # the dead rows skipped: the LM head multiplied none of them, where computed they have logits
    assert not skipped[dead].any() and computed[dead].abs().amax(dim=1).gt(0).all()


def test_paged_prefill_attends_each_piece_to_its_own_slots_causally():
    """The paged prefill op against attention computed token by token: three pieces (one in consecutive
    blocks, one in scattered blocks with 70 earlier tokens in the cache, one a prompt's start, attended
    causally without a mask), tokens interleaved in the region, padding, GQA, garbage in every other slot;
    its static-shape form (for sendnn) computes the same; and within one forward pass (step_layouts) the
    layout worked out by the first layer serves the next layer's cache."""
    from spyre_runtime.executor.kv_cache import BLOCK_SIZE, paged_prefill, static_paged_prefill, step_layouts

    torch.manual_seed(0)
    kvh, group, hd = 2, 3, 16
    key_cache = torch.randn(9, BLOCK_SIZE, kvh, hd) * 50
    value_cache = torch.randn(9, BLOCK_SIZE, kvh, hd) * 50
    tables = torch.tensor([[6, 7, 0], [5, 0, 0], [0, 0, 0], [8, 3, 2]])
    lens = torch.tensor([80, 6, 0, 130])  # piece 3: 70 earlier tokens, then 60 of this step
    token_piece = torch.tensor([0] * 10 + [1] * 6 + [3] * 60 + [-1] * 4)
    token_pos = torch.cat(
        [torch.arange(70, 80), torch.arange(6), torch.arange(70, 130), torch.zeros(4)]
    ).long()
    order = torch.randperm(80)
    token_piece, token_pos = token_piece[order], token_pos[order]
    query = torch.randn(80, kvh * group, hd)
    out = paged_prefill(query, key_cache, value_cache, tables, lens, token_piece, token_pos, hd**-0.5)
    for t in range(80):
        p = int(token_piece[t])
        if p < 0:
            assert not out[t].any()  # padding: zeros
            continue
        keys = key_cache[tables[p]].flatten(0, 1)[: token_pos[t] + 1]
        values = value_cache[tables[p]].flatten(0, 1)[: token_pos[t] + 1]
        for h in range(kvh * group):
            scores = keys[:, h // group] @ query[t, h] * hd**-0.5
            expected = torch.softmax(scores, dim=0) @ values[:, h // group]
            torch.testing.assert_close(out[t, h], expected, atol=1e-3, rtol=1e-3)  # (a wrong key: ~50)
    static = static_paged_prefill(
        query, key_cache, value_cache, tables, lens, token_piece, token_pos, hd**-0.5
    )
    torch.testing.assert_close(static, out, atol=1e-4, rtol=1e-4)
    other_keys, other_values = torch.randn_like(key_cache), torch.randn_like(value_cache)
    other = paged_prefill(query, other_keys, other_values, tables, lens, token_piece, token_pos, hd**-0.5)
    with step_layouts():
        layers = [
            paged_prefill(query, k, v, tables, lens, token_piece, token_pos, hd**-0.5)
            for k, v in ((key_cache, value_cache), (other_keys, other_values))
        ]
    torch.testing.assert_close(layers[0], out, atol=0, rtol=0)
    torch.testing.assert_close(layers[1], other, atol=0, rtol=0)
    assert not torch.allclose(other, out, atol=1e-2)


def test_paged_decode_reads_each_rows_own_slots_only():
    """The paged decode op against attention computed row by row on that row's keys: rows of different
    lengths in scattered blocks, GQA (6 query heads on 2 KV heads), and garbage in every other slot."""
    from spyre_runtime.executor.kv_cache import BLOCK_SIZE, paged_decode, static_paged_decode

    torch.manual_seed(0)
    kvh, group, hd = 2, 3, 16
    key_cache = torch.randn(9, BLOCK_SIZE, kvh, hd) * 50  # garbage: any slot read by mistake shows
    value_cache = torch.randn(9, BLOCK_SIZE, kvh, hd) * 50
    tables = torch.tensor([[4, 2, 7], [1, 0, 0], [8, 3, 0]])
    lens = torch.tensor([150, 64, 65])
    query = torch.randn(3, kvh * group, hd)
    out = paged_decode(query, key_cache, value_cache, tables, lens, hd**-0.5)
    for r in range(3):
        keys = key_cache[tables[r]].flatten(0, 1)[: lens[r]]  # [L, kvh, hd]
        values = value_cache[tables[r]].flatten(0, 1)[: lens[r]]
        for h in range(kvh * group):
            scores = keys[:, h // group] @ query[r, h] * hd**-0.5
            expected = torch.softmax(scores, dim=0) @ values[:, h // group]
            torch.testing.assert_close(out[r, h], expected, atol=1e-4, rtol=1e-4)
    # the static-shape form (for sendnn) computes the same
    static = static_paged_decode(query, key_cache, value_cache, tables, lens, hd**-0.5)
    torch.testing.assert_close(static, out, atol=1e-4, rtol=1e-4)
    # a step whose first rows only are live (linear.live_rows): those rows as before, the others zero
    from spyre_runtime.executor import linear

    for live in (2, 0):
        with linear.live_rows(live):
            few = paged_decode(query, key_cache, value_cache, tables, lens, hd**-0.5)
        torch.testing.assert_close(few[:live], out[:live], atol=1e-5, rtol=1e-5)
        assert not few[live:].any()
    # within one forward pass (step_layouts), every layer reads the rows' blocks of its own cache
    from spyre_runtime.executor.kv_cache import step_layouts

    other_keys, other_values = torch.randn_like(key_cache), torch.randn_like(value_cache)
    other = paged_decode(query, other_keys, other_values, tables, lens, hd**-0.5)
    with step_layouts(), linear.live_rows(None):
        layers = [
            paged_decode(query, k, v, tables, lens, hd**-0.5)
            for k, v in ((key_cache, value_cache), (other_keys, other_values))
        ]
    torch.testing.assert_close(layers[0], out, atol=0, rtol=0)
    torch.testing.assert_close(layers[1], other, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_packs_once_and_equals_f_linear_for_any_rows(dtype):
    from spyre_runtime.executor import linear

    onednn = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if not onednn:
        # a CPU with neither AVX-512 nor AVX-NE-CONVERT (an AVX2 EPYC): oneDNN refuses to pack bf16, so the
        # gate says so, and the layers go through the op on their plain weights all the same
        assert not linear.can_pack(dtype, "inductor")
        with pytest.raises(RuntimeError, match="bf16"):
            torch.ops.mkldnn._reorder_linear_weight(torch.randn(96, 64, dtype=dtype), 8)
    assert linear.can_pack(dtype, "inductor") == onednn and linear.can_route(dtype, "inductor")
    assert not linear.can_route(dtype, "sendnn") and not linear.can_route(torch.float16, "inductor")
    layer = torch.nn.Linear(64, 96, dtype=dtype)
    weight, bias = layer.weight.detach(), layer.bias.detach()
    with pytest.raises(RuntimeError, match="did not pack"):  # an unpacked weight is an error, not a guess
        linear.packed_linear(torch.randn(8, 64, dtype=dtype), weight, bias)
    assert linear.pack_linears(layer, 8) == 1
    packed = linear._PACKED[weight.data_ptr()]
    # oneDNN's opaque packed copy, or the plain weight itself where oneDNN packs none
    assert packed.is_mkldnn if onednn else packed.data_ptr() == weight.data_ptr()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for shape in ((8, 64), (3, 64), (1, 64), (2, 70, 64), (64, 5)):  # the last: a transposed (strided) input
        x = torch.randn(shape, dtype=dtype)
        x = x.t() if shape == (64, 5) else x
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, bias), atol=tol, rtol=tol)
    assert linear._PACKED[weight.data_ptr()] is packed  # packed once, at pack_linears
    assert not linear.can_pack(dtype, "sendnn")
    # two models one after the other (the second's weights may reuse the first's freed memory): each is
    # served by its own packed weights
    x = torch.randn(8, 64)
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        before = model(x).detach()  # (an autograd graph would keep the weights alive)
        assert linear.pack_linears(model, 8) == 2
        torch.testing.assert_close(model(x), before, atol=1e-4, rtol=1e-4)
        keys = [m.weight.data_ptr() for m in (model[0], model[2])]
        assert all(k in linear._PACKED for k in keys)  # the model's layers went through the op
        del model
        gc.collect()
        assert not any(k in linear._PACKED for k in keys)  # dropped with the layers


WARM_WITH_BUDGET = """
import sys
from pathlib import Path
from spyre_runtime.steps import ContinuousStep, PrefillChunk
from spyre_runtime.config import RuntimeConfig
from spyre_runtime.executor.model_executor import ModelExecutor
budget = int(sys.argv[2])
cfg = RuntimeConfig(model_dir=Path(sys.argv[1]), served_model_name="t", backend="inductor", use_cb=True,
                    max_model_len=128, max_num_seqs=2, max_num_batched_tokens=budget,
                    decode_batch_buckets=(2,))
ex = ModelExecutor(cfg)
ex.warmup()
chunk = PrefillChunk(None, tuple(range(1, budget - 7)), 0, budget - 8, (1, 2), True)
step = ContinuousStep((chunk,), batch_size=2, mixed=True, pieces=cfg.prefill_pieces)
served = ex.run_local(*ex.inputs.mixed(step)).isfinite().all().item()
from torch._dynamo.utils import counters
print("cache-hits", counters["inductor"]["fxgraph_cache_hit"], "served", served)
"""


def test_a_wider_token_budget_after_a_narrower_one_compiles_its_own_dynamic_chunk_graph(tiny_model, tmp_path):
    """Inductor's FX-graph cache (on disk) stores a dynamic graph with the range it was compiled for: a second
    process with a larger token budget (same model, same inductor cache) must not reuse the first's entry and
    its narrower bound, which failed the warm-up with a ConstraintViolationError. It warms and serves a chunk
    longer than the first budget allowed, without compiling; a third process with the same budget as the
    second takes both graphs from the cache (the key's tag does not make inductor bypass its cache)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    hits = []
    for budget in (64, 128, 128):
        run = subprocess.run(
            [sys.executable, "-c", WARM_WITH_BUDGET, str(tiny_model), str(budget)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.split()[-2:] == ["served", "True"]
        hits.append(int(run.stdout.split()[-3]))
    assert hits == [0, 0, 2]  # the decode graph and the dynamic mixed graph
