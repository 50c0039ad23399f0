"""One stream's decode step against the memory's read floor, in one process: issue 38's "a 1-row decode step
<= 1.3x the float32 bandwidth floor". SmolLM2 through the runtime's own ModelExecutor (inductor), the 8-row
decode graph with one live row (as a server decodes one stream), and two read probes (a float32 sum of
`--probe-gib` GiB, as matrix_bench.machine's) called in turn with it, so that all see the same minute of
the shared machine: one allocated as the weights are (4 KiB pages, unless PyTorch's THP_MEM_ALLOC_ENABLE=1),
one always on 2 MiB pages (a sum over 4 KiB pages read 0.83x as fast in one process, bench/README.md run 58).
A script with a report, not a timed test (bench/README.md runs 57 and 58).

    .venv/bin/python bench/floor_bench.py [--dtype float32] [--iters 40] [--kv 256] [--probe-gib 1]
                                          [--model DIR] [--backend inductor] [--out FILE]

Prints the medians of the compiled forward and of the whole executor step (its inputs built, then the
forward) and, for each probe, its bandwidth and the ratio to its floor: the model's weights' bytes (SmolLM2's
538 MB in float32) read at that bandwidth, each ratio the median of the iterations' own (step / the floor
measured beside it).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_attention_bench import write_results
from profile_step import decode_step, warm_executor

MADV_HUGEPAGE = 14  # Linux's madvise advice
HUGE_PAGE = 1 << 21


def huge_page_probe(gib: float) -> torch.Tensor:
    """`gib` GiB of float32 ones on 2 MiB pages whatever THP_MEM_ALLOC_ENABLE says (madvise before the
    first touch; the node's THP mode must not be `never`): the machine's best streaming read."""
    n = int(gib * (1 << 28))
    raw = torch.empty(n + HUGE_PAGE // 4)
    start = -raw.data_ptr() % HUGE_PAGE // 4  # the first element on a 2 MiB boundary
    span = (raw.numel() - start) * 4 // HUGE_PAGE * HUGE_PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(raw.data_ptr() + start * 4), ctypes.c_size_t(span), MADV_HUGEPAGE):
        raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")
    return raw[start : start + n].fill_(1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--kv", type=int, default=256)
    ap.add_argument("--probe-gib", type=float, default=1.0)
    ap.add_argument("--model", type=Path, default=None, help="a model folder instead of SmolLM2")
    ap.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    # the graph a server decodes one stream in
    ex, _, _ = warm_executor(8, args.kv, args.kv, args.dtype, backend=args.backend, model=args.model)
    step = decode_step(8, args.kv, rows=1)
    decode_args = ex.inputs.batch_decode(step)
    weights = sum(p.numel() * p.element_size() for p in ex.model.parameters())  # bytes a step reads once
    probe = torch.ones(int(args.probe_gib * (1 << 28)), dtype=torch.float32)  # pages as the weights'
    huge = huge_page_probe(args.probe_gib)
    probe.sum()
    huge.sum()

    def forward():
        ex.run_local(*decode_args, live_rows=1)

    def whole_step():
        ex.inputs.batch_decode(step)
        ex.run_local(*decode_args, live_rows=1)

    for _ in range(3):
        forward()
    times: dict[str, list[float]] = {"probe": [], "huge_probe": [], "forward": [], "step": []}
    for _ in range(args.iters):
        for name, fn in (
            ("probe", probe.sum),
            ("huge_probe", huge.sum),
            ("forward", forward),
            ("step", whole_step),
        ):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    results: dict = {"dtype": args.dtype, "threads": torch.get_num_threads()}
    results["weights_mb"] = round(weights / 1e6, 2)
    results |= {f"{name}_ms": round(med[name], 2) for name in ("forward", "step")}
    line = f"{args.dtype}: forward {results['forward_ms']} ms, step {results['step_ms']} ms"
    for probe_name, prefix, label in (("probe", "", "weights' pages"), ("huge_probe", "huge_", "huge pages")):
        # the floor of each iteration, in seconds: the weights read at the bandwidth measured beside it
        floors = [weights / (probe.numel() * 4 / t) for t in times[probe_name]]
        results[f"{prefix}read_gb_per_s"] = round(probe.numel() * 4 / (med[probe_name] / 1e3) / 1e9, 1)
        results[f"{prefix}floor_ms"] = round(statistics.median(floors) * 1e3, 2)
        for name in ("forward", "step"):
            ratios = (t / x for t, x in zip(times[name], floors, strict=True))
            results[f"{name}_over_{prefix}floor"] = round(statistics.median(ratios), 3)
        line += (
            f"; {label}: read {results[f'{prefix}read_gb_per_s']} GB/s, floor "
            f"{results[f'{prefix}floor_ms']} ms, forward {results[f'forward_over_{prefix}floor']}x"
        )
    print(line, flush=True)
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
