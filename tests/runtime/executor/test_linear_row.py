"""The few-row linear of the runtime's C++ extension (kernels/linear_row.cpp), float32 and bfloat16: equal to
F.linear on a table of shapes (rows of x and of the weight not multiples of its tiles, columns not of the
vector width, with and without bias), run by the packed linear layers for steps of at most
linear.ROW_LINEAR_ROWS[dtype] live rows and by nothing else, and clear about bad input."""

import gc

import pytest
import torch
from spyre_runtime.executor import linear
from spyre_runtime.executor.kernels import paged_attention


@pytest.fixture(scope="module")
def linear_row():
    assert paged_attention.kernel() is not None, "the runtime's C++ extension did not build here"
    return torch.ops.spyre_kernels.linear_row.default


def ran_linear_row(fn) -> tuple[torch.Tensor, bool]:
    """fn()'s result, and whether the few-row linear ran in it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, any(e.name == "spyre_kernels::linear_row" for e in prof.events())


@pytest.mark.parametrize("n_out", [1, 3, 4, 7, 960])
@pytest.mark.parametrize("k_len", [1, 5, 8, 33, 576])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 15, 29])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_row_equals_f_linear(linear_row, n_out, k_len, with_bias, rows, dtype, bf16_dot):
    gen = torch.Generator().manual_seed(n_out * 1000 + k_len)
    x, weight = torch.randn(rows, k_len, generator=gen), torch.randn(n_out, k_len, generator=gen)
    bias = torch.randn(n_out, generator=gen) if with_bias else None
    x, weight, bias = (None if t is None else t.to(dtype) for t in (x, weight, bias))
    # against float64 on the same values, within float32's rounding of a sum of k_len products added in turn
    # (the kernel's order: the textbook bound, k_len + 1 roundings of 2^-24 of the absolute sum), and for
    # bfloat16 the float32 sum's rounding to bfloat16 (half its 2^-7 step)
    exact = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    sums = x.abs().double() @ weight.abs().double().T + (0 if bias is None else bias.abs().double())
    bound = (k_len + 2) * 2**-24 * sums + 1e-7 + (2**-8 * exact.abs() if dtype == torch.bfloat16 else 0)
    outs = [linear_row(x, weight, bias)]
    if dtype == torch.float32:  # the bound holds for ATen's own float32 linear too
        outs.append(torch.nn.functional.linear(x, weight, bias))
    for out in outs:
        assert out.dtype == dtype and out.shape == (rows, n_out)
        assert ((out.double() - exact).abs() <= bound).all(), (out.double() - exact).abs().max()


def test_bfloat16_takes_the_cpus_dot_product_where_torch_finds_it_and_up_to_32_rows_without_amx(linear_row):
    """linear_row.cpp finds AVX-512 BF16 itself (its build has only the vector ISA's flags): it must agree
    with torch's own finding wherever the extension's build is AVX-512's, and then the row linear takes
    bfloat16 steps of up to BF16_DOT_ROWS live rows, unless the CPU has AMX (oneDNN's GEMM there was not
    measured against it), and where oneDNN packs no bfloat16 (ATen's plain GEMM is the other path there);
    elsewhere bfloat16 widens and keeps ROW_LINEAR_ROWS."""
    dot = torch.cpu._is_avx512_bf16_supported() and torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert torch.ops.spyre_kernels.bf16_dot() == dot
    unpacked = not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    fast = (dot and not torch.cpu._is_amx_tile_supported()) or unpacked
    most = linear.UNPACKED_BF16_ROWS if unpacked else linear.BF16_DOT_ROWS if fast else 8
    assert linear.row_limits()[torch.bfloat16] == most
    assert linear.row_limits()[torch.float32] == 32
    if dot:
        assert not torch.ops.spyre_kernels.set_bf16_dot(False)
        assert torch.ops.spyre_kernels.set_bf16_dot(True)


def test_the_row_linear_reads_the_panels_registered_for_its_weight_until_they_are_forgotten(linear_row):
    """The panels registered for a weight's address (linear.pack_linears registers every packed layer's) are
    what the row linear reads for that weight; a weight of another shape at the address, or the weight once
    they are forgotten, is put in panels of its own at the call."""
    gen = torch.Generator().manual_seed(7)
    weight, other, x = (torch.randn(*shape, generator=gen) for shape in ((40, 48), (40, 48), (3, 48)))
    key = weight.data_ptr()
    torch.ops.spyre_kernels.register_rows(key, other)
    try:
        torch.testing.assert_close(linear_row(x, weight, None), torch.nn.functional.linear(x, other))
        reshaped = weight.view(80, 24)  # the same address, another shape
        rows = x.view(-1, 24)[:5]
        expected = torch.nn.functional.linear(rows, reshaped)
        torch.testing.assert_close(linear_row(rows, reshaped, None), expected)
    finally:
        torch.ops.spyre_kernels.forget_rows(key)
    torch.testing.assert_close(linear_row(x, weight, None), torch.nn.functional.linear(x, weight))
    torch.ops.spyre_kernels.register_rows(key, other)
    torch.ops.spyre_kernels.forget_packed(key)  # what a packed layer's finalizer calls: its panels go too
    torch.testing.assert_close(linear_row(x, weight, None), torch.nn.functional.linear(x, weight))


def test_bfloat16_panels_made_in_the_other_layout_are_made_again_not_misread(linear_row):
    """Registered bfloat16 panels are in pairs along k where the dot product runs, in single values where
    bfloat16 widens: with the dot product turned off after they were made (or on after), a call puts the
    weight in panels of its own layout rather than reading the others as its own."""
    gen = torch.Generator().manual_seed(11)
    weight, other = (torch.randn(40, 48, generator=gen).bfloat16() for _ in range(2))
    x = torch.randn(3, 48, generator=gen).bfloat16()
    expected = torch.nn.functional.linear(x.float(), other.float()).bfloat16()
    dot = torch.ops.spyre_kernels.bf16_dot()
    own = torch.nn.functional.linear(x.float(), weight.float()).bfloat16()
    for made_with_dot in (True, False):
        torch.ops.spyre_kernels.set_bf16_dot(made_with_dot)
        torch.ops.spyre_kernels.register_rows(weight.data_ptr(), other)
        try:
            torch.ops.spyre_kernels.set_bf16_dot(not made_with_dot)
            packed, out = ran_packing_and(lambda: linear_row(x, weight, None))
            # two layouts only where the CPU has the dot product: then `weight` in panels of its own
            assert packed == dot
            torch.testing.assert_close(out, own if dot else expected, atol=0.05, rtol=0.02)
            torch.ops.spyre_kernels.set_bf16_dot(
                made_with_dot
            )  # the registered layout: the registered panels
            packed, out = ran_packing_and(lambda: linear_row(x, weight, None))
            assert not packed
            torch.testing.assert_close(out, expected, atol=0.05, rtol=0.02)
        finally:
            torch.ops.spyre_kernels.set_bf16_dot(True)
            torch.ops.spyre_kernels.forget_rows(weight.data_ptr())


def ran_packing_and(fn):
    """Whether the row linear put a weight in panels while fn() ran, and fn()'s result."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return any(e.name == "spyre_kernels::pack_rows" for e in prof.events()), out


def ran_packing(fn) -> bool:
    """Whether the row linear put a weight in panels while fn() ran."""
    return ran_packing_and(fn)[0]


def packed_and_run(linear_row) -> int:
    """A packed layer run for a few rows: on the panels made at load, a copy; the address of its weight."""
    layer = torch.nn.Sequential(torch.nn.Linear(48, 40))
    assert linear.pack_linears(layer, 8) == 1
    weight, x = layer[0].weight, torch.randn(3, 48)
    with torch.no_grad():
        out, ran = ran_linear_row(lambda: layer(x))
        assert ran and not ran_packing(lambda: layer(x))  # the row linear, on the panels made at load
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, layer[0].bias))
        weight.mul_(0.5)  # a weight never changes after load: the panels are a copy
        torch.testing.assert_close(layer(x), out)
        assert ran_packing(lambda: linear_row(x, weight.clone(), None))  # a weight nobody registered
    assert weight.data_ptr() in linear._PLAIN
    return weight.data_ptr()


def test_a_packed_layer_has_its_panels_made_once_at_load_and_dropped_with_it(linear_row):
    key = packed_and_run(linear_row)
    gc.collect()  # the layer's finalizer forgets its packed weight and, with it, its panels (forget_packed)
    assert key not in linear._PACKED and key not in linear._PLAIN


def test_bad_input_is_named(linear_row):
    weight = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only, x and weight alike"):
        linear_row(torch.randn(1, 16, dtype=torch.bfloat16), weight, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        linear_row(torch.randn(1, 16, dtype=torch.float16), weight.half(), None)
    with pytest.raises(RuntimeError, match="rows of 16 values"):
        linear_row(torch.randn(2, 15), weight, None)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous Float \[8\]"):
        linear_row(torch.randn(1, 16), weight, torch.randn(7))
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous BFloat16 \[8\], got Float"):
        linear_row(torch.randn(1, 16).bfloat16(), weight.bfloat16(), torch.randn(8))
    with pytest.raises(RuntimeError, match="2-d"):
        linear_row(torch.randn(1, 16), torch.randn(2, 8, 16), None)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def packed_layer(request):
    dtype = request.param
    if not linear.can_route(dtype, "inductor"):
        pytest.fail(f"{dtype} layers do not go through the packed linear op: not in use")
    layer = torch.nn.Sequential(torch.nn.Linear(48, 40).to(dtype))
    assert linear.pack_linears(layer, 8) == 1
    return layer


# a graph's rows: more than the row linear takes
ROWS = max(*linear.ROW_LINEAR_ROWS.values(), linear.BF16_DOT_ROWS) + 8


def most(layer) -> int:
    """The most live rows of a span that the row linear takes for this layer's dtype."""
    return linear._rows[layer[0].weight.dtype]


@pytest.mark.parametrize("live", [1, 2, "most"])
def test_a_step_of_a_few_live_rows_runs_the_row_linear_and_zeroes_the_dummies(linear_row, packed_layer, live):
    live = most(packed_layer) if live == "most" else live
    x = torch.randn(ROWS, 48, dtype=packed_layer[0].weight.dtype)
    expected = torch.nn.functional.linear(x[:live], packed_layer[0].weight, packed_layer[0].bias)
    with torch.no_grad(), linear.live_rows(live):
        out, ran = ran_linear_row(lambda: packed_layer(x))
    assert ran and out.shape == (ROWS, 40)
    torch.testing.assert_close(out[:live], expected)
    assert not out[live:].any()
    with torch.no_grad():  # a graph of that many rows, every row live
        out, ran = ran_linear_row(lambda: packed_layer(x[:live]))
    assert ran
    torch.testing.assert_close(out, expected)


def test_more_rows_or_the_oracle_path_run_onednn(linear_row, packed_layer):
    x = torch.randn(ROWS, 48, dtype=packed_layer[0].weight.dtype)
    with torch.no_grad():
        with linear.live_rows(most(packed_layer) + 1):
            _, ran_more = ran_linear_row(lambda: packed_layer(x))
        _, ran_all = ran_linear_row(lambda: packed_layer(x))  # every row live
        with paged_attention.disabled(), linear.live_rows(1):
            out, ran_oracle = ran_linear_row(lambda: packed_layer(x))
    every = most(packed_layer) >= ROWS  # bfloat16 where oneDNN packs none: the row linear takes every row
    assert ran_more == every and ran_all == every and not ran_oracle
    torch.testing.assert_close(
        out[:1], torch.nn.functional.linear(x[:1], packed_layer[0].weight, packed_layer[0].bias)
    )


@pytest.mark.parametrize(
    "spans",
    [
        ((0, 3), (5, 7)),
        ((0, 0), (4, 5)),
        ((2, 2), (ROWS, ROWS)),
        ((0, ROWS), (ROWS, ROWS)),
        ((1, 2), (2, ROWS - 4)),
        ((0, 1), (ROWS - 1, ROWS)),
        ((0, ROWS - 7), (ROWS - 6, ROWS)),
    ],
)
def test_live_spans_multiply_their_rows_only_in_both_kernels(linear_row, packed_layer, spans):
    """A mixed step's live rows in two spans, for inputs of one row count (linear.live_rows' `spans`): the
    C++ kernel and the Python one multiply those rows only (the row linear when they are a few) and
    zero the rest; an input of another row count keeps the prefix hint."""
    x = torch.randn(ROWS, 48, dtype=packed_layer[0].weight.dtype)
    weight, bias = packed_layer[0].weight, packed_layer[0].bias
    live = [r for start, end in spans for r in range(start, end)]
    dead = [r for r in range(ROWS) if r not in live]
    with torch.no_grad(), linear.live_rows(2, spans={ROWS: spans}):
        native, ran = ran_linear_row(lambda: packed_layer(x))
        python = linear.python_packed_linear(x, weight, bias)
        other = packed_layer(x[:5])
    # the row linear for every live row when they are a few, else oneDNN for all of them
    assert ran == (0 < len(live) <= most(packed_layer))
    for out in (native, python):
        torch.testing.assert_close(out[live], torch.nn.functional.linear(x[live], weight, bias))
        assert not out[dead].any()
    torch.testing.assert_close(other[:2], torch.nn.functional.linear(x[:2], weight, bias))
    assert not other[2:].any()


def test_bad_live_spans_are_refused_by_both_kernels():
    refused = pytest.raises(ValueError, match=r"spans \(3, 2\), \(4, 5\) out of order or beyond 8 rows")
    with refused, linear.live_rows(None, spans={8: ((3, 2), (4, 5))}):
        pass
    with pytest.raises(RuntimeError, match="out of order or beyond 8 rows"):
        torch.ops.spyre_kernels.set_live_spans([8, 0, 4, 5, 9])
    with pytest.raises(RuntimeError, match="per entry"):
        torch.ops.spyre_kernels.set_live_spans([8, 0, 4])


@pytest.fixture
def row_linear_setting(monkeypatch):
    """Sets SENDNN_INFERENCE_ROW_LINEAR for the next load (`pack_linears` reads it); the default comes back
    after, for the next test's layers."""
    yield lambda value: monkeypatch.setenv("SENDNN_INFERENCE_ROW_LINEAR", value)
    monkeypatch.undo()
    linear._read_row_setting()
    assert linear._rows == linear.row_limits()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_setting_off_makes_no_panels_and_leaves_every_row_to_onednn(
    linear_row, row_linear_setting, dtype
):
    """SENDNN_INFERENCE_ROW_LINEAR=0: the load puts no weight in panels (the third copy, which the memory
    plan then leaves out) and a step of one live row runs oneDNN's packed GEMM, with the same result."""
    if not linear.can_route(dtype, "inductor"):
        pytest.fail(f"{dtype} layers do not go through the packed linear op: not in use")
    row_linear_setting("0")
    layer = torch.nn.Sequential(torch.nn.Linear(48, 40).to(dtype))
    assert not ran_packing(lambda: linear.pack_linears(layer, 8))
    x = torch.randn(4, 48, dtype=dtype)
    with torch.no_grad(), linear.live_rows(1):
        out, ran = ran_linear_row(lambda: layer(x))
    assert not ran and not out[1:].any()
    expected = torch.nn.functional.linear(x[:1], layer[0].weight, layer[0].bias)
    torch.testing.assert_close(
        out[:1], expected, **({} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.02})
    )
    row_linear_setting("1")  # the next load turns it on again: panels made at load, the few rows its own
    other = torch.nn.Sequential(torch.nn.Linear(48, 40).to(dtype))
    assert ran_packing(lambda: linear.pack_linears(other, 8))
    with torch.no_grad(), linear.live_rows(1):
        assert ran_linear_row(lambda: other(x))[1]


def test_a_bad_setting_stops_the_load_with_its_name(row_linear_setting):
    from spyre_contract.environment import ContractError

    row_linear_setting("sometimes")
    with pytest.raises(ContractError, match="SENDNN_INFERENCE_ROW_LINEAR='sometimes' is not a boolean"):
        linear.pack_linears(torch.nn.Sequential(torch.nn.Linear(8, 8)), 8)
