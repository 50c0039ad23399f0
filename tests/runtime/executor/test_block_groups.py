"""Regional compilation's block groups once warm (compiler.BlockCompiler): a step's first group goes through
dynamo and its guards, the later groups call the graph dynamo chose for it with their own blocks' tensors,
when warm-up found that every later group ran that graph on exactly those inputs; a stack whose groups differ
keeps dynamo for every group. Inductor on a toy stack of four blocks, each in its own group."""

import contextlib

import pytest
import torch
from spyre_runtime.executor.compiler import BlockCompiler


@pytest.fixture(autouse=True)
def room_for_graphs():
    """Every BlockCompiler of a process compiles one function: the other tests' graphs count towards its
    recompile limit (as ModelExecutor.warmup allows for)."""
    with torch._dynamo.config.patch(recompile_limit=1024, accumulated_recompile_limit=4096):
        yield


class Block(torch.nn.Module):
    def __init__(self, seed: int, shift: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(seed)))
        self.shift = shift  # a constant of the block: dynamo guards on it

    def forward(self, x, past_key_value_state=None, use_cache=False, scale=None):
        # the block writes its own cache slot in place (as a KV cache) and reads a tensor of the step (scale)
        past_key_value_state.copy_(x[:, 0])
        x = torch.tanh(x @ self.weight) * scale + self.shift + past_key_value_state.sum(-1)[:, None, None]
        return (x, past_key_value_state) if use_cache else x


class Stack(torch.nn.Module):
    def __init__(self, shifts) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(i, s) for i, s in enumerate(shifts))
        self.caches = [torch.zeros(2, 8) for _ in shifts]

    def forward(self, x, scale):
        for layer, cache in zip(self.layers, self.caches, strict=True):
            x, _ = layer(x, past_key_value_state=cache, use_cache=True, scale=scale)
        return x


def reference(stack: Stack, x, scale):
    """The stack's forward by plain eager code: its output and what each block wrote to its cache."""
    written = []
    for layer in stack.layers:
        written.append(x[:, 0].clone())
        x = torch.tanh(x @ layer.weight) * scale + layer.shift + written[-1].sum(-1)[:, None, None]
    return x, written


def close(got, want):
    """Inductor's fused tanh and sums round differently from eager's, and four blocks in a chain carry values
    into the thousands: float32's default tolerance (1.3e-6 relative) failed in CI, and 400 random steps
    measured up to 6.9e-6. A group that ran another block's weights or wrote another block's cache differs by
    whole units."""
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def tokens(seed: int, count: int = 3):
    """A step's hidden states (2 rows of `count` tokens), the same on every run."""
    return torch.randn(2, count, 8, generator=torch.Generator().manual_seed(seed))


def count_dynamo_calls(blocks: BlockCompiler) -> list:
    """A list that gets an item for every group call that goes through dynamo (BlockCompiler.compiled)."""
    calls = []
    through_dynamo = blocks.compiled
    blocks.compiled = lambda *a, **k: (calls.append(1), through_dynamo(*a, **k))[1]
    return calls


def compiled_stack(shifts):
    stack = Stack(shifts)
    blocks = BlockCompiler(stack, "inductor", stack.caches)
    return stack, blocks, count_dynamo_calls(blocks)


@pytest.mark.parametrize(
    ("shifts", "direct"),
    [((0.5, 0.5, 0.5, 0.5), True), ((0.5, 0.5, 2.0, 0.5), False)],
    ids=["uniform", "a-block-differs"],
)
def test_later_groups_skip_dynamo_only_where_warmup_found_them_the_firsts(shifts, direct):
    stack, blocks, calls = compiled_stack(shifts)
    assert blocks.group == 1  # 4 blocks: a call each
    with torch.inference_mode():  # (a tensor made outside it would make the first group a graph of its own)
        x, scale = tokens(100), torch.full((1,), 0.5)
        for _ in range(2):  # warm-up: every group through dynamo, the later ones checked
            stack(x, scale)
        assert len(calls) == 8 and blocks.checked == 6
        assert blocks.serve_direct() is direct
        calls.clear()
        for step in range(3):
            xs, s = tokens(step), torch.full((1,), 0.25 * step)
            want, written = reference(stack, xs, s)
            close(stack(xs, s), want)
            for cache, expected in zip(stack.caches, written, strict=True):  # each group wrote its own
                close(cache, expected)
    # through dynamo: one group a step where the groups are uniform, all four where one block differs
    assert len(calls) == (3 if direct else 12)


def test_a_step_dynamo_has_no_graph_for_is_refused_before_any_group_runs_directly():
    stack, blocks, calls = compiled_stack((0.5,) * 4)
    with torch.inference_mode():
        stack(tokens(100), torch.ones(1))
        assert blocks.serve_direct()
        calls.clear()
        with torch.compiler.set_stance("fail_on_recompile"), pytest.raises(RuntimeError, match="recompile"):
            stack(tokens(101, 5), torch.ones(1))  # 5 tokens: no graph warmed for it
        # and the next warmed step runs whole again
        xs = tokens(0)
        close(stack(xs, torch.ones(1)), reference(stack, xs, torch.ones(1))[0])
        assert len(calls) == 2  # the first group of each step: the refused step's got no further


def test_the_decoders_later_groups_compute_what_dynamo_would_in_decode_and_mixed_steps(tiny_model):
    """The tiny Llama's two blocks, a group each, warmed: a decode step and a mixed step (its chunk's token
    count a dynamic dimension of the graph) give the same logits and KV cache with the second group called
    directly as through dynamo, and dynamo runs once a step."""
    import dataclasses

    from spyre_runtime.config import RuntimeConfig
    from spyre_runtime.executor.model_executor import ModelExecutor, mixed_live_rows
    from spyre_runtime.steps import ContinuousStep, DecodeRow, PrefillChunk

    cfg = RuntimeConfig(
        model_dir=tiny_model, served_model_name="t", backend="inductor", use_cb=True, max_model_len=128,
        max_num_seqs=4, max_num_batched_tokens=64, decode_batch_buckets=(4,), kv_len_buckets=(128,),
    )  # fmt: skip
    ex = ModelExecutor(cfg)
    ex.warmup()
    assert ex.blocks.direct and ex.blocks.group == 1
    calls = count_dynamo_calls(ex.blocks)
    decode = ContinuousStep(decode=(DecodeRow(None, 7, 10, (1,)),), batch_size=4, kv_len=128)
    chunks = (
        PrefillChunk(None, tuple(range(60, 75)), 0, 64, (4,), True),
        PrefillChunk(None, (3, 4), 0, 64, (3,), False),
    )
    mixed = dataclasses.replace(decode, chunks=chunks, mixed=True, pieces=cfg.prefill_pieces)
    mixed_args = ex.inputs.mixed(mixed)
    saved = [(k.clone(), v.clone()) for k, v in ex.kv.layers]
    for args, live in (
        (ex.inputs.batch_decode(decode), 1),
        (mixed_args, mixed_live_rows(mixed_args[0], mixed)),
    ):
        results = {}
        for direct in (False, True):
            for (k, v), (k0, v0) in zip(ex.kv.layers, saved, strict=True):
                k.copy_(k0)
                v.copy_(v0)
            ex.blocks.direct = direct
            calls.clear()
            logits = ex.run_local(*args, live_rows=live).clone()
            results[direct] = (logits, [t.clone() for layer in ex.kv.layers for t in layer], len(calls))
        assert torch.equal(results[True][0], results[False][0])
        assert all(torch.equal(a, b) for a, b in zip(results[True][1], results[False][1], strict=True))
        assert (results[False][2], results[True][2]) == (2, 1)


def test_the_compiled_graphs_wrappers_check_no_sizes_under_the_runtimes_settings():
    """compile_settings: inductor's Python wrapper of a graph leaves out its size and stride checks (84 calls
    a group graph, 0.35 ms a decode step: bench/README.md run 60); without the settings it has them."""
    from spyre_runtime.executor.compiler import compile_settings
    from torch._inductor.utils import run_and_get_code

    # two functions (two code objects): dynamo keeps its graphs by code object, and a reset would drop the
    # other tests' warm graphs in this process
    def runtime_step(x, weight):
        return torch.tanh(x @ weight).sum(-1)

    def default_step(x, weight):
        return torch.tanh(x @ weight).sum(-1)

    codes = {}
    for name, step, settings in (
        ("runtime", runtime_step, compile_settings("inductor", freeze=False)),
        ("default", default_step, contextlib.nullcontext()),
    ):
        with settings:
            fn = torch.compile(step, backend="inductor", dynamic=False)
            out, code = run_and_get_code(fn, torch.randn(4, 8), torch.randn(8, 8))
        assert out.shape == (4,)
        codes[name] = "\n".join(code)
    assert "assert_size_stride(" in codes["default"]
    assert "assert_size_stride(" not in codes["runtime"]
