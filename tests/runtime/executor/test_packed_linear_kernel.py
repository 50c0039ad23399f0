"""The packed linear op's C++ kernel (kernels/packed_linear.cpp): once the extension is loaded it is the op's
CPU kernel, gives what the Python kernel gives, bit for bit, on a table of row counts, live-row hints and
shapes (the same GEMMs underneath), runs oneDNN for one row within the oracle's `disabled()`, and forgets a
packed weight with its layer."""

import gc
import subprocess
import sys

import pytest
import torch
from spyre_runtime.executor import linear
from spyre_runtime.executor.kernels import paged_attention


@pytest.fixture(scope="module")
def loaded():
    assert paged_attention.kernel() is not None, "the runtime's C++ extension did not build here"
    if not linear.can_pack(torch.float32, "inductor"):
        pytest.fail("oneDNN cannot pack float32 weights here: the packed linear layers are not in use")


def packed(k_len: int, n_out: int, bias: bool) -> torch.nn.Linear:
    layer = torch.nn.Linear(k_len, n_out, bias=bias)
    assert linear.pack_linears(torch.nn.Sequential(layer), 8) == 1
    return layer


def registrations() -> dict[str, str]:
    """The op's kernels by dispatch key, as the dispatcher lists them (key -> where it was registered)."""
    dump = torch._C._dispatch_dump("spyre_serve::packed_linear")
    return dict(line.split(": registered at ", 1) for line in dump.splitlines() if ": registered at " in line)


def test_once_loaded_the_extension_is_the_ops_cpu_kernel(loaded):
    kernels = registrations()
    assert "kernel.cpp" in kernels["CPU"], kernels  # the extension's source, built as one file
    # the Python kernel is kept for where the extension is off, for CompositeExplicitAutograd
    assert "ops.py" in kernels["CompositeExplicitAutograd[alias]"], kernels


@pytest.mark.parametrize("shape", [(1,), (3,), (8,), (2, 4), (20,)])
@pytest.mark.parametrize("live", [None, 0, 1, 2, 8, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_the_cpp_kernel_gives_the_python_kernels_result(loaded, shape, live, bias):
    layer = packed(48, 40, bias)
    x = torch.randn(*shape, 48)
    with torch.no_grad(), linear.live_rows(live):
        cpp = linear.packed_linear(x, layer.weight, layer.bias)
        python = linear.python_packed_linear(x, layer.weight, layer.bias)
        with paged_attention.disabled():  # oneDNN for every row count, in both
            cpp_oracle = linear.packed_linear(x, layer.weight, layer.bias)
            python_oracle = linear.python_packed_linear(x, layer.weight, layer.bias)
    assert cpp.shape == (*shape, 40)
    assert torch.equal(cpp, python) and torch.equal(cpp_oracle, python_oracle)
    rows = x.numel() // 48
    n = rows if live is None else min(live, rows)
    flat = cpp.reshape(rows, 40)
    assert not flat[n:].any()  # dummy rows: zeros
    expected = torch.nn.functional.linear(x.reshape(rows, 48)[:n], layer.weight, layer.bias)
    torch.testing.assert_close(flat[:n], expected)
    torch.testing.assert_close(cpp_oracle.reshape(rows, 40), flat)


def test_a_weight_it_was_not_given_is_named_and_a_layer_gone_is_forgotten(loaded):
    weight = torch.randn(40, 48)
    with pytest.raises(RuntimeError, match=r"a weight \[40, 48\] that pack_linears did not pack"):
        linear.packed_linear(torch.randn(2, 48), weight, None)
    layer = torch.nn.Linear(48, 40, bias=False)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)  # the same memory as `weight`
    assert linear.pack_linears(torch.nn.Sequential(layer), 8) == 1
    assert linear.packed_linear(torch.randn(2, 48), weight, None).shape == (2, 40)
    del layer
    gc.collect()
    assert weight.data_ptr() not in linear._PACKED
    with pytest.raises(RuntimeError, match="did not pack"):  # the C++ kernel forgot it too
        linear.packed_linear(torch.randn(2, 48), weight, None)


def test_a_row_that_does_not_fit_the_weight_is_named(loaded):
    layer = packed(48, 40, True)
    with pytest.raises(RuntimeError, match=r"x \[2, 47\] does not fit the weight \[40, 48\]"):
        linear.packed_linear(torch.randn(2, 47), layer.weight, layer.bias)


TAKE_OVER = """
import torch
from spyre_runtime.executor import linear
from spyre_runtime.executor.kernels import paged_attention
layer = torch.nn.Linear(48, 40)
assert linear.pack_linears(torch.nn.Sequential(layer), 8) == 1
x = torch.randn(24, 48)
with torch.no_grad(), linear.live_rows(20):  # twenty rows: oneDNN, and nothing that loads the extension
    assert "\\nCPU: " not in torch._C._dispatch_dump("spyre_serve::packed_linear")
    before = linear.packed_linear(x, layer.weight, layer.bias)  # the Python kernel
    assert paged_attention.kernel() is not None
    assert "\\nCPU: " in torch._C._dispatch_dump("spyre_serve::packed_linear")
    after = linear.packed_linear(x, layer.weight, layer.bias)  # the C++ kernel, given the layer packed before
assert torch.equal(before, after) and after[:20].any() and not after[20:].any(), (before, after)
print("ok")
"""


def test_weights_packed_before_the_extension_loads_are_handed_to_it(loaded):
    """A server packs its weights while the extension builds or loads: the C++ kernel, once it serves, has
    them (a fresh process, so nothing is loaded before the layer is packed)."""
    run = subprocess.run([sys.executable, "-c", TAKE_OVER], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
