"""Waves kept whole, simulated: the real continuous scheduler (engine/sched/) driven by vLLM's client shape
(`--streams` at a fixed concurrency, `--prompt` tokens in, `--output` out, every finished request replaced at
once), a step's time taken from the step cost model (SENDNN_INFERENCE_CB_STEP_COST_US's, `--step-cost-us`)
instead of a forward. No model, no timing: it shows what the policy does to the steps, in seconds of the
cost model, with the policy off and at each `--budgets` value. A measurement needs matrix_bench.py
`--step-budget-ms`.

    .venv/bin/python bench/waves_sim.py [--chunk 1024] [--pieces 8] [--budgets 0,150,600]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.sched.factory import make_scheduler
from spyre_runtime.engine.sched.waves import StepCost
from spyre_runtime.request import Request
from spyre_runtime.sampling.params import SamplingParams


def simulate(args, budget_ms: int) -> dict:
    cfg = RuntimeConfig(
        model_dir=Path("unused"),
        served_model_name="sim",
        use_cb=True,
        backend="inductor",
        max_num_seqs=32,
        max_model_len=1024,
        max_num_batched_tokens=args.chunk,
        max_prefill_pieces=args.pieces,
        decode_batch_buckets=(8, 32),
        step_budget_ms=budget_ms,
        step_cost_us=tuple(int(x) for x in args.step_cost_us.split(",")),
    )
    sched, cost = make_scheduler(cfg), StepCost(*cfg.step_cost_us)
    now, sent, arrived, last, ttft, itl = 0.0, 0, {}, {}, [], []

    def submit():
        nonlocal sent
        req = Request(f"r{sent}", [1] * args.prompt, SamplingParams(max_tokens=args.output, temperature=0))
        sent += 1
        sched.add(req)
        arrived[req.request_id] = now

    for _ in range(args.streams):
        submit()
    while sched.has_work():
        step = sched.schedule()
        now += cost.of(step.chunk_size if step.chunks else 0, len(step.decode))
        for req in step.requests:
            req.output_token_ids.append(7)
            (itl if req.request_id in last else ttft).append(
                now - last.get(req.request_id, arrived[req.request_id])
            )
            last[req.request_id] = now
            if req.num_output_tokens >= args.output:
                req.finish("length")
        for _ in sched.update(step):
            if sent < args.requests:
                submit()
    itl.sort()
    decode_ms = cost.of(0, args.streams)
    return {
        "budget_ms": budget_ms,
        "output_tok_s": round(args.requests * args.output / now * 1000, 1),
        "ttft_p50_ms": round(statistics.median(ttft)),
        "itl_p99_ms": round(itl[int(0.99 * len(itl))]),
        "itl_max_ms": round(itl[-1]),
        "gaps_over_2_decode_steps": sum(x > 2 * decode_ms for x in itl),
        "gaps": len(itl),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=1024, help="--max-num-batched-tokens")
    ap.add_argument("--pieces", type=int, default=8, help="SENDNN_INFERENCE_CB_PREFILL_PIECES")
    ap.add_argument("--budgets", default="0,150,600", help="SENDNN_INFERENCE_CB_STEP_BUDGET_MS values")
    ap.add_argument("--step-cost-us", default="34000,900,2600")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prompt", type=int, default=192)
    ap.add_argument("--output", type=int, default=96)
    args = ap.parse_args()
    rows = [simulate(args, int(b)) for b in args.budgets.split(",")]
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
