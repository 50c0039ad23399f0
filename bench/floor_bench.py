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
from serve_bench import MODEL_DIR


def one_row_executor(dtype: str, kv: int, batch: int = 8):
    """A warm executor with SmolLM2's decode graph of `batch` rows; (executor, the step of one live row)."""
    from spyre_runtime.config import load_config
    from spyre_runtime.executor.model_executor import ModelExecutor
    from spyre_runtime.steps import ContinuousStep, DecodeRow
    from spyre_runtime.testing.models import prepare_smollm2

    prepare_smollm2(MODEL_DIR)
    env = {
        "SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor",
        "SENDNN_INFERENCE_USE_CB": "1",
        "SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES": str(batch),
        "SENDNN_INFERENCE_CB_KV_LENS": str(kv),
        "SENDNN_INFERENCE_DTYPE": dtype,
    }
    cfg = load_config(MODEL_DIR, environ=env, max_num_seqs=batch, max_model_len=kv, max_num_batched_tokens=kv)
    ex = ModelExecutor(cfg)
    ex.warmup()
    row = DecodeRow(request=None, token_id=100, position=kv // 2, block_table=tuple(range(1, 1 + kv // 64)))
    return ex, ContinuousStep(batch_size=batch, kv_len=kv, decode=(row,))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--kv", type=int, default=256)
    ap.add_argument("--probe-gib", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ex, step = one_row_executor(args.dtype, args.kv)
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
        "forward_over_floor": round(
            statistics.median(f / x for f, x in zip(times["forward"], floors, strict=True)), 3
        ),
        "step_over_floor": round(
            statistics.median(s / x for s, x in zip(times["step"], floors, strict=True)), 3
        ),
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
