"""Linear layers with weights prepacked for MKL's small-batch GEMM at the decode batch size.

A decode step is a GEMM of a few rows against every weight, and MKL runs it about 1.5x faster when the weight
is prepacked for that row count (`torch.ops.mkl._mkl_reorder_linear_weight`; measured here: 60 SmolLM2-sized
layers at 8 rows, 26 ms unpacked, 18 ms packed). Inductor prepacks by itself only under `freezing` with
`cpp.weight_prepack`, and its packed weights are opaque tensors that the graph cache cannot store, so a cached
graph ran unpacked GEMMs. Here the packing is done at run time instead, inside an op that is opaque to
the compiler: the compiled graph (cached or not) holds plain weights, and the first call with `rows` rows
packs the weight once (one extra copy of the weights per packed row count). Any other row count runs the
plain GEMM. The packed and plain GEMMs agree to float rounding, not bit for bit, so a row's logits can differ
in the last bits between a full decode step and a mixed one.

A decode step with few live rows (one stream decoding in the 8-row graph) says so with `live_rows(n)`: the op
then multiplies only the first n rows (a plain GEMM of n rows reads the weight once, as the packed one does,
without the dummy rows' work) and returns zeros for the others, which are dummy rows whose outputs are
dropped (zeros stay finite through every layer: norms, attention on the scratch slot, residuals).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F

_PACKED: dict[int, torch.Tensor] = {}  # layer slot -> its weight, MKL-packed for the slot's row count
_slots = itertools.count()
# Live rows at most this many run the plain GEMM of those rows alone (faster than the packed GEMM of all the
# rows; SmolLM2's 211 linear layers: 1, 2, 3, 4 rows plain 20.7, 22.6, 25.9, 38.7 ms; 8 rows packed 32.2 ms),
# more run the packed GEMM of every row.
FEW_ROWS = 3
_live: int | None = None  # the current step's live rows (a prefix of the inputs' rows), when set


@contextlib.contextmanager
def live_rows(n: int | None) -> Iterator[None]:
    """Within: the packed linear layers' inputs have `n` live rows first, the rest are dummies."""
    global _live
    before, _live = _live, n
    try:
        yield
    finally:
        _live = before


@torch.library.custom_op("spyre_serve::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, slot: int
) -> torch.Tensor:
    """F.linear(x, weight, bias), through the weight packed for `rows` rows when x has that many. `slot`
    names the layer (unique in the process, never reused: a freed layer's memory address may be)."""
    m = x.numel() // x.shape[-1]
    if m != rows:
        return F.linear(x, weight, bias)
    if _live is not None and _live <= FEW_ROWS:
        flat = x.reshape(m, x.shape[-1])
        out = flat.new_zeros(m, weight.shape[0])
        out[:_live] = F.linear(flat[:_live], weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])
    packed = _PACKED.get(slot)
    if packed is None:
        packed = _PACKED[slot] = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


@packed_linear.register_fake
def _(x, weight, bias, rows, slot):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def can_pack(dtype: torch.dtype, backend: str) -> bool:
    """MKL packs float32 weights for CPU backends; Spyre (sendnn) compiles its own."""
    return dtype == torch.float32 and backend != "sendnn" and torch.backends.mkl.is_available()


def _forward(module: torch.nn.Linear, rows: int, slot: int, x: torch.Tensor) -> torch.Tensor:
    return packed_linear(x, module.weight, module.bias, rows, slot)


def pack_linears(model: torch.nn.Module, rows: int) -> int:
    """Routes every plain linear layer of `model` (nn.Linear and FMS's LM head, whose forward is
    nn.Linear's; not the tensor-parallel head, which gathers) through `packed_linear` for `rows`-row inputs;
    returns how many. A layer's packed weight is dropped with the layer."""
    from fms.modules.head import LinearClassificationHead

    n = 0
    for module in model.modules():
        if type(module) in (torch.nn.Linear, LinearClassificationHead):
            slot = next(_slots)
            module.forward = functools.partial(_forward, module, rows, slot)
            weakref.finalize(module, _PACKED.pop, slot, None)
            n += 1
    return n
