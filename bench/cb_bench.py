"""Continuous vs static batching, and prefix caching on vs off, on SmolLM2 through the OpenAI endpoint.
A script with a report, not a timed test; every figure comes from one run.

    .venv/bin/python bench/cb_bench.py [--requests 48] [--rate 1.0] [--prefix-requests 12]
                                       [--model DIR] [--backend inductor] [--out bench/results-cb.json]
                                       [--logs DIR]

1. Mixed workload: prompts of 32-256 tokens, max_tokens 16-128 (ignore_eos), greedy, streaming, Poisson
   arrivals (seeded) -- the same jobs against a static-batching server (shapes 128/256 x 128 x 8) and a
   continuous-batching server (max 8 sequences, max model length 384, chunks of 256).
2. Shared prefix: requests made of one 192-token prefix plus a distinct 16-48 token tail, max_tokens 16,
   sent one at a time, against continuous batching with prefix caching on and off. TTFT of every request but
   the first (which is cold in both).
Writes bench/results-cb.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from serve_bench import (  # noqa: E402
    SHAPES,
    add_model_args,
    bench_model,
    run_load,
    with_backend,
    work_dir,
    workload,
)

from tests.runtime.serverproc import ServerProcess  # noqa: E402

CB_ENV = {
    "SENDNN_INFERENCE_USE_CB": "1",
    "SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES": "4,8",
    "SENDNN_INFERENCE_CB_KV_LENS": "128,256,384",
}
CB_ARGS = ("--max-num-seqs", "8", "--max-model-len", "384", "--max-num-batched-tokens", "256")


def poisson_arrivals(n: int, rate: float, seed: int = 1) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def shared_prefix_jobs(tokenizer, n: int, seed: int = 2) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    words = ["system", "policy", "answer", "briefly", "cluster", "operator", "reconcile", "status", "spyre"]

    def text(k):
        return " ".join(rng.choice(words) for _ in range(k * 2))

    prefix = tokenizer(text(192), add_special_tokens=False)["input_ids"][:192]
    jobs = []
    for _ in range(n):
        tail = tokenizer(" " + text(48), add_special_tokens=False)["input_ids"][: rng.randint(16, 48)]
        jobs.append((prefix + tail, 16))
    return jobs


def serve_one(
    name: str, env: dict, args: tuple, work, model_dir: Path, backend: str, logs: Path
) -> tuple[float, object]:
    """Starts a server (its log `logs`/`name`.log), runs `work(base)`, stops it; returns (seconds to ready,
    work's result)."""
    t0 = time.perf_counter()
    server = ServerProcess(
        model_dir, with_backend(env, backend), logs / f"{name}.log", served_name="smollm2", extra_args=args
    )
    try:
        server.wait_ready(timeout=3600)
        ready = time.perf_counter() - t0
        print(f"{name}: ready in {ready:.0f} s", flush=True)
        return ready, work(server.base)
    finally:
        server.stop()


def prefix_ttft(result: dict) -> dict:
    ttfts = [r["ttft"] for r in result["records"][1:]]
    return {"ttft_median_s": statistics.median(ttfts), "ttft_p99_s": max(ttfts), "requests": len(ttfts)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    ap.add_argument("--prefix-requests", type=int, default=12, help="at least 2 (the first is cold)")
    add_model_args(ap)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model_dir = bench_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    jobs = workload(tok, args.requests, seed=3)
    arrivals = poisson_arrivals(len(jobs), args.rate)
    prefix_jobs = shared_prefix_jobs(tok, args.prefix_requests)
    results: dict = {
        "machine": f"{os.cpu_count()} cores, torch {torch.__version__}, "
        f"{'SmolLM2-135M' if args.model is None else model_dir.name} fp32, {args.backend}",
        "mixed_workload": {"requests": len(jobs), "poisson_rate_per_s": args.rate},
    }

    def mixed(base):
        return asyncio.run(run_load(base, jobs, concurrency=len(jobs), arrivals=arrivals))["summary"]

    def mixed_then_prefix(base):
        return mixed(base), prefix_ttft(asyncio.run(run_load(base, prefix_jobs, concurrency=1)))

    with work_dir("spyre-cb-bench-", args.logs) as logs:

        def serve(name, env, flags, work):
            return serve_one(name, env, flags, work, model_dir, args.backend, logs)

        ready, results["static"] = serve("static", SHAPES, (), mixed)
        results["static"]["ready_s"] = ready
        ready, (results["continuous"], results["prefix_caching_on"]) = serve(
            "cb", CB_ENV, CB_ARGS, mixed_then_prefix
        )
        results["continuous"]["ready_s"] = ready

        def prefix_only(base):
            return prefix_ttft(asyncio.run(run_load(base, prefix_jobs, concurrency=1)))

        _, results["prefix_caching_off"] = serve(
            "cb-no-prefix", CB_ENV, (*CB_ARGS, "--no-enable-prefix-caching"), prefix_only
        )
    s, c = results["static"], results["continuous"]
    results["cb_vs_static_throughput"] = c["tok_per_s"] / s["tok_per_s"]
    results["cb_vs_static_ttft_p99"] = c["ttft_p99"] / s["ttft_p99"]
    on, off = results["prefix_caching_on"], results["prefix_caching_off"]
    results["prefix_ttft_speedup"] = off["ttft_median_s"] / on["ttft_median_s"]
    (args.out or REPO / "bench/results-cb.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
