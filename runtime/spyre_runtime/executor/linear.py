"""Linear layers whose weights are prepacked once for oneDNN's GEMM.

Decode steps are GEMMs of a few rows against every weight, and prefill chunks GEMMs of a few hundred rows.
oneDNN runs both far faster on a weight reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`) than the plain GEMM, which re-reads the weight in its plain
layout on every call. Measured here on SmolLM2's 121 linear layers, 2 threads, fp32: 1 row 16.7 ms packed vs
34.0 plain, 8 rows 19.0 vs 47.7, 136 rows 92 vs 243, 268 rows 189 vs 429; bf16: 8 rows 11.6 vs 15.7 (an
earlier version packed for MKL's sgemm at the decode row count only: 8 rows 50.7 ms on the same machine).
One packed weight serves every row count.

Inductor prepacks by itself only under `freezing`, and its packed weights are opaque tensors that the graph
cache cannot store. Here the packing is done at load instead (`pack_linears`), and the GEMM runs inside an op
that is opaque to the compiler: the compiled graph (cached or not) holds plain weights, and the op finds the
packed copy (one extra copy of the weights in memory). The packed and plain GEMMs agree to float rounding,
not bit for bit. Where oneDNN cannot pack a dtype (bfloat16 on an AVX2-only x86: it needs AVX-512 or
AVX-NE-CONVERT), the layers go through the op all the same (`can_route`), on their plain weights: every row of
a step takes the row linear below, which every ISA runs, in a fifth of the time of ATen's plain bf16 GEMM.

A step of a few live rows (at most `row_limits()` for the weight's dtype: 32 in float32, 8 in bfloat16, 32
where the CPU has the bfloat16 dot product and no AMX, every row where oneDNN packs no bfloat16) runs the
extension's row linear instead
(kernels/linear_row.cpp, `paged_attention.row_kernel`), on a third copy of the weight, in panels of a few
vector widths of outputs (made once the extension is loaded, `_put_in_panels`, and dropped with the layer;
SENDNN_INFERENCE_ROW_LINEAR=0 makes none and leaves every row to oneDNN, `_read_row_setting`): at one row the
layer is a matrix-vector product, bound by memory, and the panels are read at the read probe's bandwidth where
oneDNN's packed GEMM reads 10-22 GB/s (bench/README.md run 28); at a few rows each load of the weight serves
up to 8 rows with no horizontal sums. On SmolLM2's 121 weights alone, the caches written over between passes
as a step's other work does (bench/README.md run 52, a Zen 4), it took 0.55-0.80 of oneDNN's time from 1 to 40
rows in float32; in bfloat16, widened to float32 as it is loaded where oneDNN has the CPU's bf16 dot products,
0.51-0.75 up to 8 rows and 0.93-0.97 at 10 to 16 (1.06-1.12 at 12 and 16 in another run of the same day); on
the CPU's bf16 dot product itself (AVX-512 BF16, found at run time), 0.58-0.79 from 1 to 32 rows
(bench/README.md run 55).
A mixed step whose live rows are more takes oneDNN for all of them, its few decode rows too: they then read
the packed weight that the chunk's GEMM has just brought into the cache (the row linear on them, reading the
weight from memory, lost 5-12 % of bfloat16 tok/s at 4 and 8 streams in run 50). Within
`paged_attention.disabled()` oneDNN runs every row (the oracle).

A SwiGLU feed-forward (FMS's GatedLinearUnit, gate and up in one layer, SiLU) runs them through `packed_glu`:
the same decisions, and silu(gate) * up formed as the row linear makes each panel's sums (the gate's panels
and the up half's lie side by side, `register_glu_rows`), or in one pass after oneDNN's GEMM; the step's graph
no longer writes the [rows, 2 * hidden] output and reads it back in a kernel of its own.

The op's decisions (which weight, which rows, which GEMM) are made in Python until the extension is
loaded, then in its C++ kernel (kernels/packed_linear.cpp), which linear.py gives the packed weights and the
live rows: that spares 10-30 us of Python a call around the GEMM, 121 calls a step (bench/README.md run 29).

A decode step with live rows fewer than its graph's rows (one stream decoding in the 8-row graph) says so
with `live_rows(n)`: the op then multiplies only the first n rows and returns zeros for the others, which
are dummy rows whose outputs are dropped (zeros stay finite through every layer: norms, residuals);
the paged decode attention (kv_cache.paged_decode) reads the same hint and attends for the live rows only.
A mixed step (one row: the chunk region, then the decode tokens of its graph's batch bucket) says
`live_rows(tokens, decode_rows, spans)`: the paged decode attends for the first `decode_rows` of its decode
rows, and `spans` gives, by an input's row count, up to two spans of live rows: the body's GEMMs take its
chunk with the used piece places, and its live decode tokens; the LM head, which multiplies the step's last
P + B rows (P piece places, B decode rows), its used places and live decode rows, not all P + B. Between the
spans lie unused piece places, which a prefix cannot skip (a single prompt's step: 7 of 8 places, and 39 of
the head's 40 rows).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator

import torch
from spyre_contract.environment import Env

from spyre_runtime.executor.kernels import paged_attention
from spyre_runtime.executor.ops import opaque_op

_PACKED: dict[int, torch.Tensor] = {}  # a layer's weight (its data_ptr) -> the weight packed for oneDNN
# a packed layer's weight (its data_ptr) -> that weight, weakly: the row linear's panels are made from it once
# the extension is loaded (`_put_in_panels`)
_PLAIN: dict[int, weakref.ref] = {}
_GLU: set[int] = set()  # the packed weights that are a GLU's gate and up (packed_glu): panels of its layout
_live: int | None = None  # the current step's live rows (a prefix of the inputs' rows), when set
_live_decode: int | None = None  # of those, the live decode rows the paged decode attends for
Spans = tuple[tuple[int, int], tuple[int, int]]
# by the weight's dtype, at most this many live rows of a step are the row linear's (the C++ kernel is given
# them at `_take_over`): where it took clearly less time than oneDNN's packed GEMM on SmolLM2's 121 weights
# at 2 threads (bench/row_linear_bench.py, bench/README.md run 52, a Zen 4): float32 0.55-0.80x at 1 to 32
# rows (32 is the largest decode graph); bfloat16, whose GEMM oneDNN runs with the CPU's bf16 dot products
# where ours widens to float32, 0.51-0.75x up to 8 rows, 0.93-1.12x at 10 to 16 in two runs.
ROW_LINEAR_ROWS = {torch.float32: 32, torch.bfloat16: 8}
# bfloat16's, where the extension multiplies it with the CPU's bf16 dot product (linear_row.cpp `bf16_dot`)
# and the CPU has no AMX (whose oneDNN GEMM it was not measured against): 0.58-0.79x of oneDNN's time from 1
# to 32 rows on a Zen 4 (bench/README.md run 55), 32 being the largest decode graph
BF16_DOT_ROWS = 32
# bfloat16's where oneDNN packs none (an AVX2-only x86), whose other path is ATen's plain bf16 GEMM: the row
# linear, widened, took 0.20-0.57x its time from 1 to 256 rows (bench/README.md run 65), so every step's rows
UNPACKED_BF16_ROWS = 1 << 40
ROW_SETTING = "ROW_LINEAR"  # SENDNN_INFERENCE_ROW_LINEAR (`pack_linears` reads it)
_rows: dict[torch.dtype, int] = dict(ROW_LINEAR_ROWS)  # the limits in force: none while the setting is 0
_spans: dict[int, Spans] = {}  # an input's row count -> its live rows, two spans [start, end), when set


_native = False  # the extension's C++ kernel serves packed_linear (`_take_over`)
# `_PACKED` and `_native` change together; reentrant: a weight's finalizer (`_forget`) can run on a thread
# that holds it, when a garbage collection comes within
_lock = threading.RLock()


@contextlib.contextmanager
def live_rows(
    n: int | None, decode_rows: int | None = None, spans: dict[int, Spans] | None = None
) -> Iterator[None]:
    """Within: the packed linear layers' inputs have `n` live rows first, the rest are dummies; the paged
    decode's first `decode_rows` rows are live (default: `n`, a decode step's rows are its inputs' rows);
    an input of a row count in `spans` has the live rows of its two spans instead, the rest dummies."""
    global _live, _live_decode, _spans
    for rows, ((a, b), (c, d)) in (spans or {}).items():
        if not 0 <= a <= b <= c <= d <= rows:
            raise ValueError(f"live_rows: spans {(a, b)}, {(c, d)} out of order or beyond {rows} rows")
    before = _live, _live_decode, _spans
    _live, _live_decode, _spans = n, n if decode_rows is None else decode_rows, dict(spans or {})
    _tell_live()
    try:
        yield
    finally:
        _live, _live_decode, _spans = before
        _tell_live()


def _tell_live() -> None:
    if _native:
        torch.ops.spyre_kernels.set_live(-1 if _live is None else _live)
        flat = [x for rows, (a, b) in _spans.items() for x in (rows, *a, *b)]
        torch.ops.spyre_kernels.set_live_spans(flat)


def _tell_row_limits() -> None:
    if _native:
        torch.ops.spyre_kernels.set_row_limits(_rows.get(torch.float32, 0), _rows.get(torch.bfloat16, 0))


def _read_row_setting() -> None:
    """SENDNN_INFERENCE_ROW_LINEAR (boolean, default 1), read at each load: `0` turns the row linear off, so
    that no weight is put in panels (a third copy of the linear layers, as large as the packed one; the
    memory plan counts it) and oneDNN's packed GEMM runs every row, a few-row step's too, at that step's cost
    (bench/README.md run 52: the row linear takes 0.55-0.80x of oneDNN's time)."""
    on = Env().bool(ROW_SETTING, True)
    with _lock:
        _rows.clear()
        _rows.update(row_limits() if on else {})
        _tell_row_limits()


def row_limits() -> dict[torch.dtype, int]:
    """By the weight's dtype, the most live rows of a step that the row linear takes while the setting is on:
    ROW_LINEAR_ROWS, bfloat16's raised to BF16_DOT_ROWS once the extension is loaded and runs it on the CPU's
    bf16 dot product, on a CPU without AMX; to UNPACKED_BF16_ROWS (every row) where oneDNN packs no
    bfloat16."""
    limits = dict(ROW_LINEAR_ROWS)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    if _native and not amx and torch.ops.spyre_kernels.bf16_dot():
        limits[torch.bfloat16] = BF16_DOT_ROWS
    if not can_pack(torch.bfloat16, "inductor"):
        limits[torch.bfloat16] = UNPACKED_BF16_ROWS
    return limits


def _live_spans(m: int) -> Spans:
    """The live rows of an input of m rows: its own spans, else the live prefix (all rows without a hint)."""
    return _spans.get(m) or ((0, m if _live is None else min(_live, m)), (m, m))


def _take_over() -> None:
    """Once the extension is loaded (paged_attention.when_loaded): its C++ kernel of `packed_linear`
    (kernels/packed_linear.cpp, the same decisions without 10-30 us of Python a call) is given the packed
    weights, the live rows and the row linear's limits, then serves the op; the Python kernel below no longer
    runs on CPU."""
    global _native
    with _lock:
        _native = True  # from here a finalizer forgets in both
        if _rows:  # the setting is on: the limits of this extension's row linear
            _rows.update(row_limits())
        _tell_row_limits()
        for key, packed in list(_PACKED.items()):
            torch.ops.spyre_kernels.register_packed(key, packed)
            _put_in_panels(key)
            if key not in _PACKED:  # its layer went meanwhile, its finalizer on this thread
                torch.ops.spyre_kernels.forget_packed(key)
        _tell_live()
        torch.ops.spyre_kernels.serve_packed_linear()


def _put_in_panels(key: int) -> None:
    """The row linear's copy of a packed layer's weight, in its panels (kernels/linear_row.cpp), for the
    dtypes it serves: made once, read at every step of a few live rows; forgotten with the packed weight."""
    weight = _PLAIN.get(key, lambda: None)()
    if weight is not None and _rows.get(weight.dtype, 0) > 0:
        kernels = torch.ops.spyre_kernels
        (kernels.register_glu_rows if key in _GLU else kernels.register_rows)(key, weight.detach())


def _forget(key: int) -> None:
    with _lock:
        _PACKED.pop(key, None)
        _PLAIN.pop(key, None)
        _GLU.discard(key)
        if _native:
            torch.ops.spyre_kernels.forget_packed(key)


def live_row_count() -> int | None:
    """The current step's live rows (`live_rows`), or None when every row is live."""
    return _live


def live_decode_row_count() -> int | None:
    """The current step's live decode rows (`live_rows`), or None when every decode row is live."""
    return _live_decode


def _fake_linear(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def python_packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) on the weight packed for oneDNN by `pack_linears`, found by the weight's
    address: the op names no layer, so one compiled decoder block serves every block of the stack. The
    Python kernel of `packed_linear`, for CompositeExplicitAutograd, which serves CPU while no CPU kernel is
    registered: once the extension is loaded, its C++ kernel (`_take_over`) is the op's CPU kernel and makes
    the same decisions (the tests compare the two)."""
    packed = _PACKED.get(weight.data_ptr())
    if packed is None:
        raise RuntimeError(f"packed_linear: a weight {tuple(weight.shape)} that pack_linears did not pack")
    m = x.numel() // x.shape[-1]
    spans = _live_spans(m)
    live = sum(end - start for start, end in spans)
    most = _rows.get(weight.dtype, 0) if x.dtype == weight.dtype else 0
    # every live row by the row linear, or none (a mixed step's decode rows then read the packed weight that
    # its chunk's GEMM has just brought into the cache)
    row = paged_attention.row_kernel() if 0 < live <= most else None  # looked up (loaded) only when used
    if live == m and row is None:
        return packed_gemm(x, packed, bias)
    flat = x.reshape(m, x.shape[-1])
    if live == m:  # a few rows, all of them live
        return row(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])
    # only the dead rows are zeroed: a mixed step's output is hundreds of rows, zeroing all of it at each
    # of a step's ~200 GEMMs cost more than the dead rows it spares
    out = flat.new_empty(m, weight.shape[0])
    done = 0
    for start, end in spans:
        out[done:start].zero_()
        if end > start:
            rows = flat[start:end]
            out[start:end] = row(rows, weight, bias) if row is not None else packed_gemm(rows, packed, bias)
        done = max(done, end)
    out[done:].zero_()
    return out.view(*x.shape[:-1], weight.shape[0])


packed_linear = opaque_op(
    "packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    _fake_linear,
    key="CompositeExplicitAutograd",
)(python_packed_linear)


def _fake_glu(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


def python_packed_glu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up of a GLU whose gate and up halves are one packed weight [2 * hidden, K] (gate first):
    `python_packed_linear`, then the product of its halves. The Python kernel of `packed_glu`, the C++ one's
    fallback and oracle; that one (kernels/packed_linear.cpp) multiplies a few live rows by the GLU's panels
    and forms the product as each panel's sums are made, and otherwise follows oneDNN's GEMM with it in one
    pass (the compiled graph's own fused kernel did that pass before)."""
    gate, up = python_packed_linear(x, weight, bias).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


packed_glu = opaque_op(
    "packed_glu(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    _fake_glu,
    key="CompositeExplicitAutograd",
)(python_packed_glu)


def can_pack(dtype: torch.dtype, backend: str) -> bool:
    """oneDNN packs float32 (and, where the CPU has it, bfloat16) weights for CPU backends; Spyre (sendnn)
    compiles its own."""
    if backend == "sendnn" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def can_route(dtype: torch.dtype, backend: str) -> bool:
    """The linear layers of a CPU backend go through `packed_linear` in float32 and bfloat16, packed for
    oneDNN where it can pack the dtype (`can_pack`); where it cannot (bfloat16 on an AVX2-only x86, no
    AVX-512 and no AVX-NE-CONVERT), the op's "packed" weight is the plain weight itself, and every row of a
    step takes the row linear (widened to float32 on at::vec, so on every ISA; `row_limits`), with ATen's
    plain GEMM, which the layer ran before, as its oracle (`paged_attention.disabled()`)."""
    return backend != "sendnn" and dtype in ROW_LINEAR_ROWS


def weight_routing(dtype: str, backend: str) -> str:
    """What the linear layers of a model in `dtype` (a name) keep beside their weights on this CPU, as the
    memory plan counts it (spyre_contract.memory.ROUTINGS): a packed copy and panels, panels, or neither."""
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype):
        return "packed"  # a name torch does not know: the most, as the operator counts
    return "none" if not can_route(kind, backend) else "packed" if can_pack(kind, backend) else "plain"


def packed_copy(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """The weight packed for oneDNN, tuned for `rows`; the weight itself where oneDNN cannot pack its dtype
    (`packed_gemm` then runs ATen's plain GEMM on it)."""
    if can_pack(weight.dtype, "inductor"):
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    return weight


def packed_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's GEMM on the packed weight (an opaque oneDNN tensor), or ATen's where the packed entry is the
    plain weight itself."""
    if not packed.is_mkldnn:
        return torch.nn.functional.linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return packed_linear(x, self.weight, self.bias)


def _glu_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.w2(packed_glu(x, self.wg1_fused.weight, self.wg1_fused.bias))


@functools.cache
def _glu_class(cls: type) -> type:
    """FMS's GatedLinearUnit with its gate, up and SiLU through `packed_glu` (one op, no [.., 2 * hidden]
    output written and read back); its down projection stays a packed linear layer."""
    return type(f"Packed{cls.__name__}", (cls,), {"forward": _glu_forward})


def _fused_swiglu(module: torch.nn.Module) -> bool:
    """A GatedLinearUnit exactly (not a tensor-parallel one, which gathers) whose gate and up are one linear
    layer and whose activation is SiLU, without dropout (none, or in eval mode, as the runtime serves): what
    `packed_glu` computes."""
    from fms.modules.feedforward import GatedLinearUnit

    return (
        type(module) is GatedLinearUnit
        and module.fused
        and type(module.a) is torch.nn.SiLU
        and not (module.p_dropout and module.training)
        and type(module.wg1_fused) is torch.nn.Linear
    )


@functools.cache
def _packed_class(cls: type) -> type:
    """`cls` with its forward through `packed_linear`. A class, not a per-layer bound forward: the compiler
    guards on a layer's class, so every block of the stack shares one compiled graph."""
    return type(f"Packed{cls.__name__}", (cls,), {"forward": _forward})


def pack_linears(model: torch.nn.Module, rows: int) -> int:
    """Packs the weight of every plain linear layer of `model` (nn.Linear and FMS's LM head, whose forward is
    nn.Linear's; not the tensor-parallel head, which gathers) for oneDNN, tuned for `rows` (the decode batch;
    any row count runs), and routes the layer through `packed_linear`; returns how many. A packed weight is
    dropped with its weight tensor (before its address can be reused), and a weight shared by two layers (tied
    embeddings) is packed once. A SwiGLU feed-forward whose gate and up are one layer (`_fused_swiglu`) runs
    them and its SiLU through `packed_glu` instead."""
    from fms.modules.head import LinearClassificationHead

    _read_row_setting()
    n = 0
    for module in model.modules():  # a GLU before its layers
        if _fused_swiglu(module):
            key = module.wg1_fused.weight.data_ptr()
            with _lock:
                _GLU.add(key)
                if _native and key in _PACKED:  # packed before as a plain layer: panels of the GLU's layout
                    _put_in_panels(key)
            module.__class__ = _glu_class(type(module))
        if type(module) in (torch.nn.Linear, LinearClassificationHead):
            key = module.weight.data_ptr()
            with _lock:
                if key not in _PACKED:
                    _PACKED[key] = packed_copy(module.weight.detach(), rows)
                    _PLAIN[key] = weakref.ref(module.weight)
                    weakref.finalize(module.weight, _forget, key)
                    if _native:
                        torch.ops.spyre_kernels.register_packed(key, _PACKED[key])
                        _put_in_panels(key)
            module.__class__ = _packed_class(type(module))
            n += 1
    return n


paged_attention.when_loaded(_take_over)
