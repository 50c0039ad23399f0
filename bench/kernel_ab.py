"""The paged decode-attention kernel against another version of its own source: both built in one process
(each under its own op namespace) and called in turn on the same inputs, so that the two builds share the
hour, the heat and the memory's state. A script with a report, not a timed test.

    git show HEAD~1:runtime/spyre_runtime/executor/kernels/paged_attention.cpp > /tmp/before.cpp
    .venv/bin/python bench/kernel_ab.py /tmp/before.cpp [--after FILE] [--iters 30] [--out FILE]
    .venv/bin/python bench/kernel_ab.py --prefill /tmp/before_prefill.cpp [--after FILE] ...

`--after` defaults to the runtime's own source. Every case is 30 layers' calls on SmolLM2's heads (9 query,
3 KV, head size 64; blocks of 64, scattered as serving leaves them). Prints each build's median, their ratio
and the largest difference of their outputs (0 when the arithmetic's order is unchanged). `--prefill`: the
two files are versions of paged_prefill.cpp, each built in the extension's whole text, and the cases are one
prompt piece's attention (`PREFILL_CASES`: its tokens, the cached tokens before it, the dtype).
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
PREFILL_CASES = [  # (tokens, cached tokens before them, dtype)
    (192, 0, torch.float32),
    (192, 0, torch.bfloat16),
    (192, 0, torch.float16),
    (256, 0, torch.float32),
    (256, 0, torch.bfloat16),
    (256, 0, torch.float16),
    (100, 300, torch.float32),
    (100, 300, torch.bfloat16),
]


def build(source: Path, namespace: str, prefill: bool = False):
    """The kernel of `source` built (or loaded from its cached build) as torch.ops.<namespace>; with
    `prefill`, the extension's whole text with `source` as its paged_prefill.cpp."""
    from spyre_runtime.executor.kernels import paged_attention
    from torch.utils import cpp_extension

    text = source.read_text()
    if prefill:
        text = "\n".join(
            text if s.name == "paged_prefill.cpp" else s.read_text() for s in paged_attention.SOURCES
        )
    text = text.replace("spyre_kernels", namespace)
    flags = paged_attention.build_flags()
    digest = hashlib.sha256((text + " ".join(flags)).encode()).hexdigest()[:16]
    name = f"spyre_kernel_ab_{namespace}_{digest}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    paged_attention.compile_extension(name, text, directory)
    ops = getattr(torch.ops, namespace)
    return ops.paged_prefill.default if prefill else ops.paged_decode.default


def prefill_layers(n: int, start: int, dtype: torch.dtype) -> list[tuple]:
    """30 layers of one prompt piece: its query, the caches, its blocks (scattered), start and scale."""
    gen = torch.Generator().manual_seed(0)
    blocks = -(-(start + n) // 64)
    layers = []
    for _ in range(LAYERS):
        kc, vc = (torch.randn(64, 64, 3, 64, generator=gen).to(dtype) for _ in "kv")
        query = torch.randn(n, 9, 64, generator=gen).to(dtype)
        layers.append((query, kc, vc, torch.randperm(63, generator=gen)[:blocks] + 1, start, 0.125, None, 0))
    return layers


def cases(prefill: bool) -> list[tuple[str, list[tuple]]]:
    """(name, the 30 layers' arguments) of each case."""
    if prefill:
        return [
            (f"{n} at {start} {str(d)[6:]}", prefill_layers(n, start, d)) for n, start, d in PREFILL_CASES
        ]
    return [
        (name, [(*case_inputs(rows, 9, 3, 64, longest, dtype, seed=i), None, 0, -1) for i in range(LAYERS)])
        for name, rows, longest, dtype in CASES
    ]


def main() -> int:
    from spyre_runtime.executor.kernels import paged_attention

    ap = argparse.ArgumentParser()
    ap.add_argument("before", type=Path, help="the other version of paged_attention.cpp (paged_prefill.cpp)")
    ap.add_argument("--after", type=Path, default=None, help="default: the runtime's own source")
    ap.add_argument("--prefill", action="store_true", help="the prompt piece's kernel (paged_prefill.cpp)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--cases", type=int, default=None, help="the first N cases")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    own = paged_attention.SOURCE.with_name("paged_prefill.cpp") if args.prefill else paged_attention.SOURCE
    args.after = args.after or own
    ops = {
        "before": build(args.before, "spyre_kernels_before", args.prefill),
        "after": build(args.after, "spyre_kernels_after", args.prefill),
    }
    results = {"before": str(args.before), "after": str(args.after), "flags": paged_attention.build_flags()}
    results |= {"threads": torch.get_num_threads(), "cases": []}
    for name, layers in cases(args.prefill)[: args.cases]:
        outs = {side: op(*layers[0]) for side, op in ops.items()}
        diff = (outs["before"].float() - outs["after"].float()).abs().max().item()
        times: dict[str, list[float]] = {side: [] for side in ops}
        for _ in range(args.iters):
            for side, op in ops.items():
                t = time.perf_counter()
                for layer in layers:
                    op(*layer)
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
