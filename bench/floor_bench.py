"""One stream's decode step against the memory's read floor, in one process: issue 38's "a 1-row decode step
<= 1.3x the float32 bandwidth floor". SmolLM2 through the runtime's own ModelExecutor (inductor), the 8-row
decode graph with one live row (as a server decodes one stream), and a read probe (a float32 sum of
`--probe-gib` GiB, as matrix_bench.machine's) called in turn with it, so that both see the same minute of
the shared machine. A script with a report, not a timed test (bench/README.md run 57).

    .venv/bin/python bench/floor_bench.py [--dtype float32] [--iters 40] [--kv 256] [--probe-gib 1]
                                          [--out FILE]

Prints the medians of the compiled forward, of the whole executor step (its inputs built, then the forward)
and of the probe's bandwidth; the floor is the weights' bytes (matrix_bench.WEIGHT_BYTES_FP32, halved for
bfloat16) read at that bandwidth, and each ratio is the median of the iterations' own (step / the floor
measured beside it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matrix_bench import WEIGHT_BYTES_FP32
from paged_attention_bench import write_results
from profile_step import decode_step, warm_executor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--kv", type=int, default=256)
    ap.add_argument("--probe-gib", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ex, _, _ = warm_executor(8, args.kv, args.kv, args.dtype)  # the graph a server decodes one stream in
    step = decode_step(8, args.kv, rows=1)
    decode_args = ex.inputs.batch_decode(step)
    weights = WEIGHT_BYTES_FP32 / (2 if args.dtype == "bfloat16" else 1)
    probe = torch.ones(int(args.probe_gib * (1 << 28)), dtype=torch.float32)
    probe.sum()

    def forward():
        ex.run_local(*decode_args, live_rows=1)

    def whole_step():
        ex.inputs.batch_decode(step)
        ex.run_local(*decode_args, live_rows=1)

    for _ in range(3):
        forward()
    times: dict[str, list[float]] = {"probe": [], "forward": [], "step": []}
    for _ in range(args.iters):
        for name, fn in (("probe", probe.sum), ("forward", forward), ("step", whole_step)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    floors = [weights / (probe.numel() * 4 / t) for t in times["probe"]]  # seconds, iteration by iteration
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    results = {
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "read_gb_per_s": round(probe.numel() * 4 / (med["probe"] / 1e3) / 1e9, 1),
        "floor_ms": round(statistics.median(floors) * 1e3, 2),
        "forward_ms": round(med["forward"], 2),
        "step_ms": round(med["step"], 2),
        **{
            f"{name}_over_floor": round(
                statistics.median(t / x for t, x in zip(times[name], floors, strict=True)), 3
            )
            for name in ("forward", "step")
        },
    }
    print(
        f"{args.dtype}: read {results['read_gb_per_s']} GB/s, floor {results['floor_ms']} ms; "
        f"forward {results['forward_ms']} ms ({results['forward_over_floor']}x), "
        f"step {results['step_ms']} ms ({results['step_over_floor']}x)",
        flush=True,
    )
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
