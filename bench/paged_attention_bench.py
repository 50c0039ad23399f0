"""The paged decode attention alone: the C++ kernel (runtime/spyre_runtime/executor/kernels) against the ATen
ops it replaces (kv_cache.paged_decode with the kernel disabled), on SmolLM2's and a GQA-8 model's heads.
A script with a report, not a timed test.

    .venv/bin/python bench/paged_attention_bench.py [--iters 50] [--dtype float32] [--out FILE]

Every case is one layer's call; each row owns its own blocks, scattered over the cache as serving leaves
them. Prints the median of each path, alternating the two per iteration, and their ratio. In bfloat16 on a
CPU with the bf16 dot product, also prompt pieces on it against widened (`prefill_dot`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

CASES = [  # (name, rows, heads, kv heads, head_dim, context tokens per row)
    ("smollm2 1 row x 256", 1, 9, 3, 64, 256),
    ("smollm2 1 row x 1000", 1, 9, 3, 64, 1000),
    ("smollm2 8 rows x 200-256", 8, 9, 3, 64, 256),
    ("smollm2 32 rows x 200-256", 32, 9, 3, 64, 256),
    ("smollm2 32 rows x 800-1000", 32, 9, 3, 64, 1000),
    ("gqa8 hd128 8 rows x 2000", 8, 32, 8, 128, 2000),
    ("gqa8 hd128 1 row x 8000", 1, 32, 8, 128, 8000),
]


def case_inputs(rows, heads, kvheads, head_dim, longest, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    per_row = -(-longest // 64)
    num_blocks = 1 + rows * per_row
    key_cache = torch.randn(num_blocks, 64, kvheads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, 64, kvheads, head_dim, generator=gen).to(dtype)
    table = (torch.randperm(num_blocks - 1, generator=gen)[: rows * per_row] + 1).view(rows, per_row)
    # ragged: rows between 80 % and 100 % of the longest
    seq_lens = torch.randint(int(longest * 0.8), longest + 1, (rows,), generator=gen)
    query = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    return query, key_cache, value_cache, table, seq_lens, head_dim**-0.5


def write_results(results: dict, out: Path | None) -> None:
    """Adds the load average to `results` and writes them to `out` as JSON (when there is one)."""
    results["load_average"] = os.getloadavg()
    if out:
        out.write_text(json.dumps(results, indent=2) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from spyre_runtime.executor import kv_cache
    from spyre_runtime.executor.kernels import paged_attention

    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    op = paged_attention.kernel()
    if op is None:
        print("the kernel did not build (see the log); nothing to compare", file=sys.stderr)
        return 1
    results = {"kernel_ready_s": time.perf_counter() - t0, "extension": paged_attention.extension_name()}
    results |= {"flags": paged_attention.build_flags(), "threads": torch.get_num_threads(), "cases": []}
    for name, rows, heads, kvheads, head_dim, longest in CASES:
        inputs = case_inputs(rows, heads, kvheads, head_dim, longest, dtype)
        aten, kernel = [], []
        for _ in range(args.iters):
            with paged_attention.disabled():
                t = time.perf_counter()
                expected = kv_cache.paged_decode(*inputs)
                aten.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = kv_cache.paged_decode(*inputs)
            kernel.append(time.perf_counter() - t)
        err = (got.float() - expected.float()).abs().max().item()
        row = {
            "case": name,
            "aten_ms": statistics.median(aten) * 1e3,
            "kernel_ms": statistics.median(kernel) * 1e3,
        }
        row |= {"speedup": row["aten_ms"] / row["kernel_ms"], "max_abs_diff": err}
        results["cases"].append(row)
        print(
            f"{name:32s} aten {row['aten_ms']:8.3f} ms  kernel {row['kernel_ms']:8.3f} ms  "
            f"{row['speedup']:5.2f}x  diff {err:.1e}",
            flush=True,
        )
    if dtype == torch.bfloat16 and torch.ops.spyre_kernels.bf16_dot():
        results["prefill_dot"] = prefill_dot(args.iters)
    write_results(results, args.out)
    return 0


# a prompt piece's (start, tokens), SmolLM2's heads, 30 layers a step
PIECES = [(0, 144), (0, 256), (128, 128)]


def prefill_dot(iters: int) -> list[dict]:
    """bfloat16 prompt pieces (kernels/paged_prefill.cpp) on the CPU's bf16 dot product against widened to
    float32 (every other CPU's path), alternating per iteration: a step's 30 layers' calls (bench/README.md
    run 55)."""
    op, rows = torch.ops.spyre_kernels, []
    gen = torch.Generator().manual_seed(0)
    for start, n in PIECES:
        blocks = -(-(start + n) // 64)
        caches = [torch.randn(blocks + 4, 64, 3, 64, generator=gen).bfloat16() for _ in range(2)]
        query, table = torch.randn(n, 9, 64, generator=gen).bfloat16(), torch.randperm(blocks + 4)[:blocks]
        times: dict[bool, list[float]] = {True: [], False: []}
        outs = {}
        for _ in range(iters):
            for dot in (True, False):
                op.set_bf16_dot(dot)
                t = time.perf_counter()
                for _ in range(30):
                    outs[dot] = op.paged_prefill(query, *caches, table, start, 0.125, None, 0)
                times[dot].append(time.perf_counter() - t)
        op.set_bf16_dot(True)
        dot_ms, widened_ms = (statistics.median(times[d]) * 1e3 for d in (True, False))
        diff = (outs[True].float() - outs[False].float()).abs().max().item()
        rows.append({"start": start, "tokens": n, "dot_ms": dot_ms, "widened_ms": widened_ms, "diff": diff})
        print(
            f"prompt piece {start}+{n} x 30 layers: dot product {dot_ms:.2f} ms, "
            f"widened {widened_ms:.2f} ms, {dot_ms / widened_ms:.2f}x, diff {diff:.1e}",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
