"""The runtime's few-row linear (kernels/linear_row.cpp) against oneDNN's packed GEMM (linear.py) on
SmolLM2-135M's 121 weights, one decode step's calls, called in turn in one process so both share the
hour, the heat and the memory's state; since run 52 the caches are written over between two passes. A
script with a report, not a timed test (bench/README.md runs 50 and 52): it chose linear.ROW_LINEAR_ROWS.

    .venv/bin/python bench/row_linear_bench.py [--dtype float32] [--rows 1,2,3,4,5,6,8,16] [--iters 12]
                                               [--flush-mb 64] [--out FILE]

Prints, for each row count, both medians of the whole step's linear layers and their ratio (ours / oneDNN's);
in bfloat16 on a CPU with the bf16 dot product, also ours widened to float32 (every other CPU's panels).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_attention_bench import write_results

HIDDEN, KV, MLP, LAYERS, VOCAB = 576, 192, 1536, 30, 49152  # SmolLM2-135M
# a layer's weights [out, in] as FMS serves them (q, k and v fused, gate and up fused): qkv, o, gate-up, down;
# then the LM head: 121 weights, a decode step's calls
SHAPES = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)]


def layer_bench_args(doc: str | None, rows: str, iters: int) -> argparse.Namespace:
    """The command line of a bench over SmolLM2's layers in one process (this one and glu_bench.py)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=rows)
    ap.add_argument("--iters", type=int, default=iters)
    ap.add_argument(
        "--flush-mb",
        type=int,
        default=64,
        help="MB written between two passes, so neither finds weights in the L3 (0: none, as in runs 50-51)",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args()


def extension_built() -> bool:
    """Whether the runtime's C++ extension loads here; says so on stderr where it does not."""
    from spyre_runtime.executor.kernels import paged_attention

    if paged_attention.kernel() is None:
        print("the runtime's C++ extension did not build here", file=sys.stderr)
        return False
    return True


def main() -> int:
    args = layer_bench_args(__doc__, "1,2,3,4,5,6,8,16", 12)
    if not extension_built():
        return 1
    from spyre_runtime.executor import linear

    gen, dtype = torch.Generator().manual_seed(0), getattr(torch, args.dtype)
    shapes = SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    weights = [(torch.randn(n, k, generator=gen) * 0.02).to(dtype) for n, k in shapes]
    # oneDNN's packed copies; where it packs no such dtype (bfloat16 on AVX2), the plain weights and ATen's
    # GEMM, as the runtime runs them there (linear.packed_copy)
    packed = [linear.packed_copy(w, 8) for w in weights]
    for w in weights:  # the row linear's panels, made once as linear.pack_linears has them made
        torch.ops.spyre_kernels.register_rows(w.data_ptr(), w)
    ours_op = torch.ops.spyre_kernels.linear_row.default
    # bfloat16 where the CPU has the bf16 dot product: also the widened panels (every other CPU's), on copies
    # of the weights registered with the dot product off, so that both layouts are made once
    dot = dtype == torch.bfloat16 and torch.ops.spyre_kernels.bf16_dot()
    copies = [w.clone() for w in weights] if dot else []
    torch.ops.spyre_kernels.set_bf16_dot(False)
    for w in copies:
        torch.ops.spyre_kernels.register_rows(w.data_ptr(), w)
    torch.ops.spyre_kernels.set_bf16_dot(True)
    results = {
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "flush_mb": args.flush_mb,
        "weights_mb": sum(w.numel() * w.element_size() for w in weights) / 1e6,
        "onednn_packs": linear.can_pack(dtype, "inductor"),  # else the "onednn" arm is ATen's plain GEMM
    }
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in (HIDDEN, MLP)}

        def ours(xs=xs):
            return [ours_op(xs[w.shape[1]], w, None) for w in weights]

        def onednn(xs=xs):
            pairs = zip(weights, packed, strict=True)
            return [linear.packed_gemm(xs[w.shape[1]], p, None) for w, p in pairs]

        def widened(xs=xs):
            torch.ops.spyre_kernels.set_bf16_dot(False)
            try:
                return [ours_op(xs[w.shape[1]], w, None) for w in copies]
            finally:
                torch.ops.spyre_kernels.set_bf16_dot(True)

        kinds = {"ours": ours, "onednn": onednn, **({"widened": widened} if dot else {})}
        times: dict[str, list[float]] = {name: [] for name in kinds}
        flush = torch.zeros(args.flush_mb << 18)  # float32: MB * 2^20 / 4
        for _ in range(2):
            for fn in kinds.values():
                fn()
        for _ in range(args.iters):
            for name, fn in kinds.items():
                flush.add_(1.0)  # a step's other work (attention, the KV cache) between two passes
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e3)
        a, b = statistics.median(times["ours"]), statistics.median(times["onednn"])
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(ours()[-1], onednn()[-1], rtol=tolerance, atol=tolerance)
        results[f"rows_{m}"] = {"ours_ms": round(a, 2), "onednn_ms": round(b, 2), "ratio": round(a / b, 3)}
        line = f"{m} rows: ours {a:.1f} ms, oneDNN {b:.1f} ms, {a / b:.2f}x"
        # the same rows widened to float32, as before the dot product's panels (bench/README.md run 55)
        if dot:
            c = statistics.median(times["widened"])
            torch.testing.assert_close(widened()[-1], onednn()[-1], rtol=tolerance, atol=tolerance)
            results[f"rows_{m}"] |= {"widened_ms": round(c, 2), "dot_over_widened": round(a / c, 3)}
            line += f"; widened {c:.1f} ms, dot product / widened {a / c:.2f}x"
        print(line, flush=True)
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
