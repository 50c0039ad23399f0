"""The C++ attention of a prompt piece (kernels/paged_prefill.cpp) against the ATen path it replaces in a
mixed step (kv_cache.paged_prefill within paged_attention.disabled(): the blocks gathered, torch's
attention), which stays its fallback and oracle: a table of pieces (a prompt's start and a later chunk,
lengths across blocks and tiles, scattered blocks, GQA and MQA, a window, sinks, head sizes, float32 and
bfloat16), several pieces in one region beside decode rows and padding, and its errors."""

from __future__ import annotations

import pytest
import torch
from spyre_runtime.executor import kv_cache
from spyre_runtime.executor.kernels import paged_attention

BLOCK = kv_cache.BLOCK_SIZE


@pytest.fixture(scope="module")
def prefill():
    """The op on a piece's own tokens; the mixed step runs its in-place form (`prefill_kernel()`)."""
    assert paged_attention.kernel() is not None, "the runtime's C++ extension did not build here"
    return torch.ops.spyre_kernels.paged_prefill.default


def region(pieces, heads, kvheads, head_dim, dtype, seed=0):
    """A mixed step's chunk region: pieces (start, n) of prompts whose blocks are scattered over a cache of
    large garbage (a slot read by mistake shows), their tokens in order, then each piece's last token at a
    place of its own (as StepInputs.mixed lays them), 3 padding tokens (piece -1) and 5 decode rows."""
    gen = torch.Generator().manual_seed(seed)
    per_piece = max(-(-(start + n) // BLOCK) for start, n in pieces)
    num_blocks = 1 + len(pieces) * per_piece
    key_cache = (torch.randn(num_blocks, BLOCK, kvheads, head_dim, generator=gen) * 4).to(dtype)
    value_cache = (torch.randn(num_blocks, BLOCK, kvheads, head_dim, generator=gen) * 4).to(dtype)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(pieces), per_piece, dtype=torch.long)
    body_piece, body_pos, last_piece, last_pos = [], [], [], []
    for p, (start, n) in enumerate(pieces):
        tables[p] = order[p * per_piece : (p + 1) * per_piece]
        body_piece += [p] * (n - 1)
        body_pos += list(range(start, start + n - 1))
        last_piece.append(p)
        last_pos.append(start + n - 1)
    token_piece = torch.tensor(body_piece + [-1] * 3 + last_piece + [-1] * 5)
    token_pos = torch.tensor(body_pos + [0] * 3 + last_pos + [0] * 5)
    query = torch.randn(len(token_piece), heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([start + n for start, n in pieces])
    return query, key_cache, value_cache, tables, lens, token_piece, token_pos


def both(args, scale, sinks, window):
    """The step's paged prefill with the kernel, and with the ATen path (the oracle)."""
    with kv_cache.step_layouts():
        fast = kv_cache.paged_prefill(*args, scale, sinks, window)
    with paged_attention.disabled(), kv_cache.step_layouts():
        slow = kv_cache.paged_prefill(*args, scale, sinks, window)
    return fast, slow


CASES = [  # pieces (start, n), heads, kv heads, head_dim, window, sinks
    pytest.param([(0, 144)], 9, 3, 64, 0, False, id="a-prompt-start-smollm2"),
    pytest.param([(0, 1), (0, 8), (0, 17)], 9, 3, 64, 0, False, id="short-prompts-within-a-tile"),
    pytest.param([(70, 60), (0, 300)], 9, 3, 64, 0, False, id="a-later-chunk-beside-a-start"),
    pytest.param([(0, 200), (130, 70)], 8, 2, 128, 100, True, id="window-sinks-gqa4-hd128"),
    pytest.param([(0, 90), (5, 33)], 32, 1, 64, 0, True, id="mqa-32-heads-one-kv"),
    pytest.param([(0, 129)], 4, 4, 16, 4096, False, id="mha-head-dim-16-window-wider-than-context"),
    pytest.param([(63, 2), (64, 64)], 6, 3, 32, 7, False, id="block-edges-and-a-narrow-window"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("pieces", "heads", "kvheads", "head_dim", "window", "with_sinks"), CASES)
def test_the_kernel_equals_the_aten_path(
    prefill, pieces, heads, kvheads, head_dim, window, with_sinks, dtype, bf16_dot
):
    """bfloat16 on the CPU's bf16 dot product (its weights rounded to bfloat16) and widened alike."""
    args = region(pieces, heads, kvheads, head_dim, dtype)
    sinks = torch.linspace(-2, 3, heads) if with_sinks else None
    fast, slow = both(args, head_dim**-0.5, sinks, window)
    if dtype == torch.float32:
        torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-4)
    else:  # bfloat16: as close to the float64 result as the oracle is (its sinks' softmax runs in bfloat16)
        wide = [a.double() if a.is_floating_point() else a for a in args]
        with paged_attention.disabled(), kv_cache.step_layouts():
            exact = kv_cache.paged_prefill(
                *wide, head_dim**-0.5, None if sinks is None else sinks.double(), window
            )
        error = {
            name: (out.double() - exact).abs().max().item() for name, out in (("fast", fast), ("slow", slow))
        }
        assert error["fast"] <= error["slow"] * 1.05 + 1e-3, error
    token_piece = args[5]
    assert not fast[token_piece < 0].any()  # padding and decode rows: zeros, as the ATen path leaves them
    assert fast[token_piece >= 0].abs().amax(dim=(1, 2)).gt(0).all()


@pytest.mark.parametrize(("pieces", "heads", "kvheads", "head_dim", "window", "with_sinks"), CASES)
def test_a_float32_query_over_a_bfloat16_cache_equals_the_aten_path(
    prefill, pieces, heads, kvheads, head_dim, window, with_sinks
):
    """--kv-cache-dtype bfloat16 under a float32 model: both paths widen the cache and sum in float32."""
    query, key_cache, value_cache, *rest = region(pieces, heads, kvheads, head_dim, torch.float32)
    args = (query, key_cache.bfloat16(), value_cache.bfloat16(), *rest)
    sinks = torch.linspace(-2, 3, heads) if with_sinks else None
    fast, slow = both(args, head_dim**-0.5, sinks, window)
    assert fast.dtype == slow.dtype == torch.float32
    torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-4)
    # the kernel served it: it widens on load, so a float32 cache of the same values gives the same bits (the
    # ATen path's sums differ in the last place)
    with kv_cache.step_layouts():
        widened = (query, args[1].float(), args[2].float(), *rest)
        wide = kv_cache.paged_prefill(*widened, head_dim**-0.5, sinks, window)
    torch.testing.assert_close(fast, wide, atol=0, rtol=0)


def test_the_op_reads_only_the_piece_s_blocks_and_its_positions(prefill):
    """Called directly: a later chunk (positions 70..99) of a prompt in blocks [4, 2]; the keys and values of
    every other block, and of the slots after each token's position, are NaN and change nothing."""
    torch.manual_seed(1)
    key_cache, value_cache = (
        torch.full((6, BLOCK, 2, 64), float("nan")),
        torch.full((6, BLOCK, 2, 64), float("nan")),
    )
    for b in (4, 2):
        key_cache[b], value_cache[b] = torch.randn(BLOCK, 2, 64), torch.randn(BLOCK, 2, 64)
    query = torch.randn(30, 6, 64)
    out = prefill(query, key_cache, value_cache, torch.tensor([4, 2]), 70, 0.125, None, 0)
    keys = torch.cat([key_cache[4], key_cache[2]])[:100]
    values = torch.cat([value_cache[4], value_cache[2]])[:100]
    for i in (0, 13, 29):
        for h in (0, 5):
            scores = keys[: 71 + i, h // 3] @ query[i, h] * 0.125
            expected = torch.softmax(scores, dim=0) @ values[: 71 + i, h // 3]
            torch.testing.assert_close(out[i, h], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_it_reads_and_writes_the_given_rows_of_the_region_and_no_other(prefill, dtype):
    """paged_prefill_rows (what a mixed step runs): the piece's token t is the region's row rows[t], read
    from the query and written to out; every other row of out stays as it was, and each written row equals
    the op on the piece's own tokens gathered."""
    gen = torch.Generator().manual_seed(3)
    key_cache, value_cache = (torch.randn(6, BLOCK, 2, 64, generator=gen).to(dtype) for _ in range(2))
    query = torch.randn(40, 6, 64, generator=gen).to(dtype)
    rows = torch.tensor([*range(5, 34), 38])  # 29 tokens in order, the last one at a place of its own
    out = torch.full_like(query, 7.0)
    in_place, table = paged_attention.prefill_kernel(), torch.tensor([4, 2])
    in_place(query, rows, out, key_cache, value_cache, table, 70, 0.125, None, 0)
    piece = prefill(query.index_select(0, rows), key_cache, value_cache, table, 70, 0.125, None, 0)
    torch.testing.assert_close(out.index_select(0, rows), piece, atol=0, rtol=0)
    others = torch.ones(40, dtype=torch.bool)
    others[rows] = False
    assert (out[others] == 7.0).all()
    with pytest.raises(RuntimeError, match=r"paged_prefill_rows: row 40 is outside the query's 40 tokens"):
        in_place(query, torch.tensor([3, 40]), out, key_cache, value_cache, table, 0, 1.0, None, 0)
    with pytest.raises(RuntimeError, match="paged_prefill_rows: query and out must be contiguous and alike"):
        in_place(query, rows, out[:39], key_cache, value_cache, table, 70, 1.0, None, 0)


def test_bad_input_is_named(prefill):
    cache = torch.zeros(3, BLOCK, 2, 64)
    with pytest.raises(RuntimeError, match=r"positions 100 to 130 are outside the piece's 1 blocks"):
        prefill(torch.zeros(30, 4, 64), cache, cache, torch.tensor([1]), 100, 1.0, None, 0)
    with pytest.raises(RuntimeError, match="the query must have it or be float32"):
        prefill(torch.zeros(3, 4, 64, dtype=torch.bfloat16), cache, cache, torch.tensor([1]), 0, 1.0, None, 0)
    with pytest.raises(RuntimeError, match="5 query heads do not share 2 KV heads evenly"):
        prefill(torch.zeros(3, 5, 64), cache, cache, torch.tensor([1]), 0, 1.0, None, 0)
    with pytest.raises(RuntimeError, match="must be multiples of the vector width"):
        prefill(
            torch.zeros(3, 4, 6),
            torch.zeros(3, BLOCK, 2, 6),
            torch.zeros(3, BLOCK, 2, 6),
            torch.tensor([1]),
            0,
            1.0,
            None,
            0,
        )
    with pytest.raises(RuntimeError, match=r"sinks must hold one logit per query head \(4\)"):
        prefill(torch.zeros(3, 4, 64), cache, cache, torch.tensor([1]), 0, 1.0, torch.zeros(3), 0)


def test_the_first_prompt_piece_of_a_process_waits_for_the_kernel(tmp_path):
    """A process whose first attention is a prompt piece runs it on the kernel (it waits for the build, as the
    decode does), not on the ATen ops because nothing had loaded the kernel yet (found in review)."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from spyre_runtime.executor import kv_cache\n"
        "from spyre_runtime.executor.kernels import paged_attention as pa\n"
        "gen = torch.Generator().manual_seed(0)\n"
        "q = torch.randn(40, 9, 64, generator=gen)\n"
        "k, v = (torch.randn(3, kv_cache.BLOCK_SIZE, 3, 64, generator=gen) for _ in 'kv')\n"
        "args = (q, k, v, torch.tensor([[1, 2]]), torch.tensor([40]), torch.zeros(40, dtype=torch.long),\n"
        "        torch.arange(40), 0.125)\n"
        "with kv_cache.step_layouts():\n"
        "    got = kv_cache.paged_prefill(*args)\n"
        "direct = torch.ops.spyre_kernels.paged_prefill(q, k, v, torch.tensor([1, 2]), 0, 0.125, None, 0)\n"
        "print(bool(pa._op and pa._op[0] is not None), torch.equal(got, direct))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"], done.stdout + done.stderr
