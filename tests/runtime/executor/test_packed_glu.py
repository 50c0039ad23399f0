"""A SwiGLU feed-forward in one op (linear.packed_glu; kernels/linear_row.cpp `linear_row_glu`,
kernels/packed_linear.cpp): silu(gate) * up of a weight holding the gate and up halves, equal to float64's on
a table of shapes (halves not multiples of a panel's width, rows not of the kernel's row tiles, with and
without bias, both bfloat16 paths), its panels never taken for a plain layer's or the reverse, the C++ op
agreeing with its Python kernel for every live-row hint (and in the oracle's oneDNN path), FMS's fused
SwiGLU routed through it by pack_linears and nothing else, and bad input named."""

import pytest
import torch
import torch.nn.functional as F
from fms.modules.feedforward import GatedLinearUnit
from spyre_runtime.executor import linear
from spyre_runtime.executor.kernels import paged_attention


@pytest.fixture(scope="module")
def glu_row():
    assert paged_attention.kernel() is not None, "the runtime's C++ extension did not build here"
    return torch.ops.spyre_kernels.linear_row_glu.default


def exact_glu(x, weight, bias):
    """float64's silu(gate) * up, and a bound on a float32 kernel's error: each half's sum within the
    textbook bound of k_len + 1 roundings of 2^-24 of its absolute sum, carried through silu (slope at most
    1.1) and the product, plus the vector exp's and the product's own rounding."""
    k_len = x.shape[-1]
    b = None if bias is None else bias.double()
    full = F.linear(x.double(), weight.double(), b)
    sums = x.abs().double() @ weight.abs().double().T + (0 if bias is None else bias.abs().double())
    err = (k_len + 2) * 2**-24 * sums + 1e-7
    gate, up = full.chunk(2, dim=-1)
    err_g, err_u = err.chunk(2, dim=-1)
    exact = F.silu(gate) * up
    bound = 1.1 * err_g * (up.abs() + err_u) + F.silu(gate).abs() * err_u + 2**-20 * exact.abs() + 1e-7
    return exact, bound


@pytest.mark.parametrize("half", [1, 7, 40, 48, 100])
@pytest.mark.parametrize("k_len", [5, 64])
@pytest.mark.parametrize("rows", [1, 3, 9, 32])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_row_glu_equals_silu_of_gate_times_up(glu_row, half, k_len, rows, with_bias, dtype, bf16_dot):
    gen = torch.Generator().manual_seed(half * 1000 + k_len * 10 + rows)
    x, weight = torch.randn(rows, k_len, generator=gen), torch.randn(2 * half, k_len, generator=gen) / 4
    bias = torch.randn(2 * half, generator=gen) if with_bias else None
    x, weight, bias = (None if t is None else t.to(dtype) for t in (x, weight, bias))
    exact, bound = exact_glu(x, weight, bias)
    if dtype == torch.bfloat16:  # the float32 result's one rounding to bfloat16 (half its 2^-7 step)
        bound = bound + 2**-8 * exact.abs()
    out = glu_row(x, weight, bias)
    assert out.dtype == dtype and out.shape == (rows, half)
    assert ((out.double() - exact).abs() <= bound).all(), (out.double() - exact).abs().max()


@pytest.mark.parametrize("half", [40, 48])  # 40: both layouts of [80, K] are 2 panels, of other contents
def test_glu_panels_and_plain_panels_are_never_read_as_each_other(glu_row, half):
    """Registered panels in the GLU layout (each half in panels of its own) serve linear_row_glu for their
    weight's address; the plain row linear of that weight puts it in panels of its own, and the reverse:
    where the two layouts have one shape (a half of 40: 2 panels either way) they differ in content."""
    gen = torch.Generator().manual_seed(half)
    weight, other = (torch.randn(2 * half, 48, generator=gen) for _ in range(2))
    x = torch.randn(3, 48, generator=gen)
    key, tol = weight.data_ptr(), {"atol": 1e-5, "rtol": 1e-5}
    torch.ops.spyre_kernels.register_glu_rows(key, other)
    try:
        torch.testing.assert_close(glu_row(x, weight, None), exact_glu(x, other, None)[0].float(), **tol)
        plain = torch.ops.spyre_kernels.linear_row(x, weight, None)
        torch.testing.assert_close(plain, F.linear(x, weight), **tol)
        torch.ops.spyre_kernels.register_rows(key, other)
        plain = torch.ops.spyre_kernels.linear_row(x, weight, None)
        torch.testing.assert_close(plain, F.linear(x, other), **tol)
        torch.testing.assert_close(glu_row(x, weight, None), exact_glu(x, weight, None)[0].float(), **tol)
    finally:
        torch.ops.spyre_kernels.forget_rows(key)


def test_bad_input_is_named(glu_row):
    with pytest.raises(RuntimeError, match=r"linear_row_glu: weight must have an even count of outputs"):
        glu_row(torch.randn(2, 8), torch.randn(7, 8), None)
    with pytest.raises(RuntimeError, match=r"linear_row_glu: x must be rows of 8 values, got \[2, 9\]"):
        glu_row(torch.randn(2, 9), torch.randn(6, 8), None)
    with pytest.raises(RuntimeError, match=r"linear_row_glu: bias must be a contiguous"):
        glu_row(torch.randn(2, 8), torch.randn(6, 8), torch.randn(3))


def swiglu(width: int, dtype=torch.float32, **kwargs) -> GatedLinearUnit:
    settings = {"hidden_grow_factor": 2.5, "multiple_of": 8, "activation_fn": torch.nn.SiLU(), "fused": True}
    glu = GatedLinearUnit(width, p_dropout=0.0, **settings | kwargs).to(dtype).eval()
    gen = torch.Generator().manual_seed(width)
    with torch.no_grad():
        for p in glu.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / 8)
    return glu


@pytest.mark.parametrize("shape", [(1,), (3,), (8,), (2, 4), (20,)])
@pytest.mark.parametrize("live", [None, 0, 1, 2, 8, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_op_agrees_with_its_python_kernel_for_every_live_hint(glu_row, shape, live, dtype):
    """packed_glu's C++ kernel (the row linear's GLU up to the dtype's limit, else oneDNN then the GLU in one
    pass) against its Python kernel (packed_linear, then silu * up in ATen), in the row linear's path and in
    the oracle's (oneDNN for every row): the same values to the rounding of the one intermediate the fused
    kernel skips, dead rows zero in both."""
    glu = swiglu(48, dtype, use_bias=True)
    assert linear.pack_linears(glu, 8) == 2 and type(glu).__name__ == "PackedGatedLinearUnit"
    weight, bias = glu.wg1_fused.weight, glu.wg1_fused.bias
    x = torch.randn(*shape, 48).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    with torch.no_grad(), linear.live_rows(live):
        cpp = linear.packed_glu(x, weight, bias)
        python = linear.python_packed_glu(x, weight, bias)
        with paged_attention.disabled():
            cpp_oracle = linear.packed_glu(x, weight, bias)
            python_oracle = linear.python_packed_glu(x, weight, bias)
    rows = x.numel() // 48
    n = rows if live is None else min(live, rows)
    assert cpp.shape == (*shape, glu.hidden_dim) and cpp.dtype == dtype
    flat = cpp.reshape(rows, -1)
    assert not flat[n:].any() and not cpp_oracle.reshape(rows, -1)[n:].any()  # dummy rows: zeros
    torch.testing.assert_close(cpp, python, **tol)
    torch.testing.assert_close(cpp_oracle, python_oracle, **tol)
    exact, _ = exact_glu(x.reshape(rows, 48)[:n], weight, bias)
    torch.testing.assert_close(flat[:n].double(), exact, **tol)


def ran(fn) -> tuple[torch.Tensor, set[str]]:
    """fn()'s result, and the names of the ops that ran in it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.name for e in prof.events()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_linears_routes_a_fused_swiglu_through_the_op_and_few_rows_to_the_row_glu(glu_row, dtype):
    glu = swiglu(64, dtype)
    x = torch.randn(1, 40, 64).to(dtype)
    with torch.no_grad():
        before = glu(x)
        assert linear.pack_linears(glu, 8) == 2
        most = linear.row_limits()[dtype]
        # (more rows than the limit are oneDNN's, unless the row linear takes every row: bf16 unpacked)
        for live, by_rows in ((3, True), (most, True), (most + 1, most >= x.shape[1])):
            with linear.live_rows(live):
                out, names = ran(lambda: glu(x))
            assert "spyre_serve::packed_glu" in names
            assert ("spyre_kernels::linear_row_glu" in names) == by_rows, (live, names)
            tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
            torch.testing.assert_close(out[:, :live], before[:, :live], **tol)
            assert not out[:, live:].any()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"activation_fn": torch.nn.ReLU()},  # not a SwiGLU
        {"activation_fn": torch.nn.GELU()},
        {"fused": False},  # gate and up apart: two packed layers, as before
    ],
    ids=["relu", "gelu", "unfused"],
)
def test_other_feed_forwards_keep_their_own_forward(glu_row, kwargs):
    glu = swiglu(64, **kwargs)
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        before = glu(x)
        assert linear.pack_linears(glu, 8) == (2 if kwargs.get("fused", True) else 3)
        out, names = ran(lambda: glu(x))
    assert type(glu).__name__ == "GatedLinearUnit" and "spyre_serve::packed_glu" not in names
    torch.testing.assert_close(out, before, atol=1e-5, rtol=1e-4)
