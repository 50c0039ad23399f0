"""Warmup of SmolLM2 with 4 static shapes: cold graph cache vs warm graph cache, in one run.
A script with a report, not a timed test.

    .venv/bin/python bench/cache_bench.py [--model DIR] [--shapes 4] [--out bench/results-cache.json]

Runs `spyre-runtime compile` twice against a fresh TORCH_SENDNN_CACHE_DIR: the first start compiles every
graph and publishes the entry, the second loads it. Each is a fresh process with a fresh private inductor
directory, so nothing but the shared cache carries over. Writes bench/results-cache.json. `--model DIR`
compiles another model folder, `--shapes N` the first N shapes only (the smoke run: a tiny model, one shape).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = Path.home() / ".cache/spyre-serve/models/smollm2"
SHAPES = {
    "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64,128,192,256",
    "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "32,64,64,128",
    "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "1,4,8,8",
}


def first_shapes(count: int) -> dict:
    return {key: ",".join(value.split(",")[:count]) for key, value in SHAPES.items()}


def compile_once(cache_dir: Path, model_dir: Path = MODEL_DIR, shapes: dict = SHAPES) -> dict:
    env = {
        **os.environ,
        **shapes,
        "SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor",
        "TORCH_SENDNN_CACHE_ENABLE": "1",
        "TORCH_SENDNN_CACHE_DIR": str(cache_dir),
    }
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "spyre_runtime.cli", "compile", str(model_dir)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    summary["process_seconds"] = time.perf_counter() - t0
    return summary


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None, help="a model folder instead of SmolLM2")
    ap.add_argument("--shapes", type=int, default=4, choices=range(1, 5), help="the first N of the 4 shapes")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results-cache.json")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "runtime"))
    from spyre_runtime.testing.models import prepare_smollm2

    model_dir = args.model or prepare_smollm2(MODEL_DIR)
    shapes = first_shapes(args.shapes)
    with tempfile.TemporaryDirectory(prefix="spyre-cache-bench-") as tmp:
        cache = Path(tmp)
        cold = compile_once(cache, model_dir, shapes)
        warm = compile_once(cache, model_dir, shapes)
        size = sum(p.stat().st_size for p in (cache / "entries").rglob("*") if p.is_file())
    name = "SmolLM2-135M" if args.model is None else model_dir.name
    results = {
        "machine": f"{os.cpu_count()} cores, {name} fp32, inductor, {args.shapes} static shapes",
        "shapes": shapes,
        "cold": cold,
        "warm": warm,
        "entry_bytes": size,
        "warmup_speedup": cold["warmup_seconds"] / warm["warmup_seconds"],
        "process_speedup": cold["process_seconds"] / warm["process_seconds"],
    }
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
