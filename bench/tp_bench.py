"""Tensor parallelism on this 2-core machine: decode step time and throughput at N = 1 and N = 2, and the
per-step cost of sending the step to the other rank. A script with a report, not a timed test.

    .venv/bin/python bench/tp_bench.py [--models tiny,small] [--backend inductor] [--out FILE]

Models with heads that divide by 2 (8 attention heads, 4 KV heads), seeded random weights: the tiny test
model (hidden 64, 2 layers) and a small one (hidden 512, 8 layers) where compute is less dwarfed by
communication. Static batching, one shape (prompt 64, 64 new tokens, batch 4), inductor. Both ranks share the
same 2 cores (each rank gets 1 thread at N = 2), so the figure that matters is overhead, not speed-up.
Writes bench/results-tp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def measure(model_dir: Path, tp: int, backend: str = "inductor") -> dict:
    from spyre_runtime.config import RuntimeConfig, Shape
    from spyre_runtime.engine.llm_engine import LLMEngine
    from spyre_runtime.executor.loader import configure_threads
    from spyre_runtime.sampling.params import SamplingParams

    config = RuntimeConfig(
        model_dir=model_dir, served_model_name="m", backend=backend, shapes=(Shape(64, 64, 4),)
    )
    config = replace(config, tensor_parallel_size=tp)
    threads = configure_threads(config)
    engine = LLMEngine(config)
    send_seconds: list[float] = []
    try:
        engine.executor.warmup()
        workers = engine.executor.workers
        if workers is not None:
            plain_send = workers.send

            def timed_send(op, payload=None):
                t0 = time.perf_counter()
                plain_send(op, payload)
                send_seconds.append(time.perf_counter() - t0)

            workers.send = timed_send
        steps: list[float] = []
        engine.on_step = lambda step, s: None if step.is_prefill else steps.append(s)
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        for round_ in range(2):
            for i in range(4):
                engine.add_request([5 + i + round_] * (20 + 10 * i), params)
            while engine.has_work():
                engine.step()
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    return {
        "threads_per_rank": threads,
        "decode_step_ms_median": statistics.median(steps) * 1e3,
        "output_tok_per_s": 8 * 64 / wall,
        "send_step_ms_median": statistics.median(send_seconds) * 1e3 if send_seconds else 0.0,
    }


SIZES = {"tiny": ("tiny (hidden 64, 2 layers)", 64, 2), "small": ("small (hidden 512, 8 layers)", 512, 8)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,small", help=f"a comma list of {', '.join(SIZES)}")
    ap.add_argument("--backend", default="inductor", choices=("inductor", "eager"))
    ap.add_argument("--out", type=Path, default=REPO / "bench/results-tp.json")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "runtime"))
    from spyre_runtime.testing.models import write_tiny_model

    results: dict = {"machine": f"{os.cpu_count()} cores, {args.backend}, static shape (64, 64, 4)"}
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for size in args.models.split(","):
            label, hidden, layers = SIZES[size]
            models[label] = write_tiny_model(
                Path(tmp) / size, heads=8, kv_heads=4, hidden=hidden, num_layers=layers, seed=3
            )
        for label, model_dir in models.items():
            one, two = measure(model_dir, 1, args.backend), measure(model_dir, 2, args.backend)
            results[label] = {
                "n1": one,
                "n2": two,
                "step_ratio_n2_over_n1": two["decode_step_ms_median"] / one["decode_step_ms_median"],
            }
            print(label, json.dumps(results[label]), flush=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
