"""The paged decode-attention kernel against another version of its own source: both built in one process
(each under its own op namespace) and called in turn on the same inputs, so that the two builds share the
hour, the heat and the memory's state. A script with a report, not a timed test.

    git show HEAD~1:runtime/spyre_runtime/executor/kernels/paged_attention.cpp > /tmp/before.cpp
    .venv/bin/python bench/kernel_ab.py /tmp/before.cpp [--after FILE] [--iters 30] [--out FILE]

`--after` defaults to the runtime's own source. Every case is 30 layers' calls on SmolLM2's heads (9 query,
3 KV, head size 64; blocks of 64, scattered as serving leaves them). Prints each build's median, their ratio
and the largest difference of their outputs (0 when the arithmetic's order is unchanged).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_attention_bench import case_inputs, write_results

LAYERS = 30
CASES = [  # (name, rows, context tokens per row, dtype)
    ("1 x 384 float32", 1, 384, torch.float32),
    ("8 x 384 float32", 8, 384, torch.float32),
    ("32 x 384 float32", 32, 384, torch.float32),
    ("32 x 384 bfloat16", 32, 384, torch.bfloat16),
    ("1 x 2000 float32", 1, 2000, torch.float32),
]


def build(source: Path, namespace: str):
    """The kernel of `source` built (or loaded from its cached build) as torch.ops.<namespace>."""
    from spyre_runtime.executor.kernels import paged_attention
    from torch.utils import cpp_extension

    text = source.read_text().replace("spyre_kernels", namespace)
    flags = paged_attention.build_flags()
    digest = hashlib.sha256((text + " ".join(flags)).encode()).hexdigest()[:16]
    name = f"spyre_kernel_ab_{namespace}_{digest}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    paged_attention.compile_extension(name, text, directory)
    return getattr(torch.ops, namespace).paged_decode.default


def main() -> int:
    from spyre_runtime.executor.kernels import paged_attention

    ap = argparse.ArgumentParser()
    ap.add_argument("before", type=Path, help="the other version of paged_attention.cpp")
    ap.add_argument("--after", type=Path, default=paged_attention.SOURCE)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--cases", type=int, default=len(CASES), help="the first N cases")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ops = {
        "before": build(args.before, "spyre_kernels_before"),
        "after": build(args.after, "spyre_kernels_after"),
    }
    results = {"before": str(args.before), "after": str(args.after), "flags": paged_attention.build_flags()}
    results |= {"threads": torch.get_num_threads(), "cases": []}
    for name, rows, longest, dtype in CASES[: args.cases]:
        layers = [case_inputs(rows, 9, 3, 64, longest, dtype, seed=i) for i in range(LAYERS)]
        outs = {side: op(*layers[0], None, 0, -1) for side, op in ops.items()}
        diff = (outs["before"].float() - outs["after"].float()).abs().max().item()
        times: dict[str, list[float]] = {side: [] for side in ops}
        for _ in range(args.iters):
            for side, op in ops.items():
                t = time.perf_counter()
                for layer in layers:
                    op(*layer, None, 0, -1)
                times[side].append((time.perf_counter() - t) * 1e3)
        row = {"case": name, **{f"{side}_ms": statistics.median(times[side]) for side in ops}}
        row |= {"after_over_before": row["after_ms"] / row["before_ms"], "max_abs_diff": diff}
        results["cases"].append(row)
        print(
            f"{name:20s} before {row['before_ms']:8.2f} ms  after {row['after_ms']:8.2f} ms  "
            f"{row['after_over_before']:5.3f}x  diff {diff:.1e}",
            flush=True,
        )
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
