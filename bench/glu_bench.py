"""A SwiGLU feed-forward's gate, up and SiLU on SmolLM2-135M's 30 layers, one step's calls: linear.packed_glu
(one op: the row linear's GLU up to the dtype's row limit, else oneDNN's GEMM then the GLU in one pass)
against what the compiled graph ran before it, linear.packed_linear of the fused [2 * 1536, 576] weight then
inductor's kernel of silu(gate) * up. Both alternate in one process, with the caches written over between
two passes (as in row_linear_bench.py). A script with a report, not a timed test (bench/README.md run 56).

    .venv/bin/python bench/glu_bench.py [--dtype float32] [--rows 1,8,32,288] [--iters 15] [--out FILE]

Prints, for each row count, both medians of the 30 layers and their ratio (one op / before).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from fms.modules.feedforward import GatedLinearUnit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_attention_bench import write_results
from row_linear_bench import HIDDEN, LAYERS, MLP, extension_built, layer_bench_args


def main() -> int:
    args = layer_bench_args(__doc__, "1,8,32,288", 15)
    if not extension_built():
        return 1
    from spyre_runtime.executor import linear

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)

    def layer() -> torch.nn.Linear:
        out = torch.nn.Linear(HIDDEN, 2 * MLP, bias=False)
        with torch.no_grad():
            out.weight.copy_(torch.randn(out.weight.shape, generator=gen) * 0.02)
        return out.to(dtype)

    plain = torch.nn.Sequential(*(layer() for _ in range(LAYERS)))  # packed as plain layers
    glus = torch.nn.ModuleList()  # FMS's SwiGLU of the same weights, packed as pack_linears packs a model's
    for twin in plain:
        glu = GatedLinearUnit(
            HIDDEN, MLP / HIDDEN, 1, torch.nn.SiLU(), p_dropout=0.0, use_bias=False, fused=True
        )
        assert glu.hidden_dim == MLP
        glu = glu.to(dtype).eval()
        with torch.no_grad():
            glu.wg1_fused.weight.copy_(twin.weight)
        glus.append(glu)
    linear.pack_linears(plain, 8)
    linear.pack_linears(glus, 8)
    silu_times_up = torch.compile(lambda t: F.silu(t[..., :MLP]) * t[..., MLP:], dynamic=False)
    results = {"dtype": args.dtype, "threads": torch.get_num_threads(), "flush_mb": args.flush_mb}
    with torch.no_grad():
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(1, m, HIDDEN, generator=gen).to(dtype)

            def before(x=x):
                return [silu_times_up(linear.packed_linear(x, w.weight, None)) for w in plain]

            def fused(x=x):
                return [linear.packed_glu(x, g.wg1_fused.weight, None) for g in glus]

            kinds = {"before": before, "packed_glu": fused}
            times: dict[str, list[float]] = {name: [] for name in kinds}
            flush = torch.zeros(args.flush_mb << 18)
            for _ in range(2):
                for fn in kinds.values():
                    fn()
            for _ in range(args.iters):
                for name, fn in kinds.items():
                    flush.add_(1.0)
                    start = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - start) * 1e3)
            tolerance = 1e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(fused()[-1], before()[-1], rtol=tolerance, atol=tolerance)
            a, b = statistics.median(times["packed_glu"]), statistics.median(times["before"])
            results[f"rows_{m}"] = {
                "packed_glu_ms": round(a, 2),
                "before_ms": round(b, 2),
                "ratio": round(a / b, 3),
            }
            print(f"{m} rows: packed_glu {a:.2f} ms, before {b:.2f} ms, {a / b:.2f}x", flush=True)
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
