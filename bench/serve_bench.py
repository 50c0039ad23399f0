"""Seeded load generator against the runtime's OpenAI endpoint, with HF transformers baselines measured in the
same run on the same model and prompts. A script with a report, not a timed test.

    .venv/bin/python bench/serve_bench.py [--requests 64] [--concurrency 8] [--hf-requests 16] [--cb]
                                          [--model DIR] [--backend inductor] [--out bench/results-serve.json]
                                          [--logs DIR]

`--model DIR` serves another model folder instead of SmolLM2 (served as "smollm2"; tests/test_bench_smoke.py
runs every bench on a tiny model with one request, `--backend eager`, so that a bench cannot stop measuring
unnoticed). The servers' logs go to a temporary folder of the run's own, removed at its end; `--logs DIR`
keeps them (every serving bench takes it).

Workload: prompts of 32-256 tokens, max_tokens 16-128 (ignore_eos, so every system generates the same
counts), greedy, streaming, concurrency 8. Writes bench/results-serve.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from tests.runtime.serverproc import ServerProcess  # noqa: E402

MODEL_DIR = Path.home() / ".cache/spyre-serve/models/smollm2"
SHAPES = {
    "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "128,256",
    "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "128,128",
    "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "8,8",
}


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The flags every serving bench shares: which model, which backend, where the JSON and the logs go."""
    ap.add_argument("--model", type=Path, default=None, help="a model folder instead of SmolLM2")
    ap.add_argument("--backend", default="inductor", choices=("inductor", "eager"))
    ap.add_argument("--out", type=Path, default=None, help="where the results go (default: bench/results-*)")
    ap.add_argument("--logs", type=Path, default=None, help="keep the servers' logs in this folder")


@contextlib.contextmanager
def work_dir(prefix: str, logs: Path | None):
    """A temporary folder for the servers' logs and fresh caches; with `logs`, every log in it is copied
    there when the run ends, failed or not (a failed peer's log used to go with the folder)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        try:
            yield Path(tmp)
        finally:
            if logs is not None:
                logs.mkdir(parents=True, exist_ok=True)
                for log in Path(tmp).glob("*.log"):
                    shutil.copy2(log, logs / log.name)
                print(f"logs kept in {logs}", flush=True)


def bench_model(model: Path | None) -> Path:
    """The folder to serve: `--model`, else SmolLM2 (built from its wheel once)."""
    if model is not None:
        return model
    from spyre_runtime.testing.models import prepare_smollm2

    return prepare_smollm2(MODEL_DIR)


def with_backend(env: dict, backend: str) -> dict:
    return {**env, "SENDNN_INFERENCE_DYNAMO_BACKEND": backend}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))] if values else float("nan")


def workload(tokenizer, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    words = [
        "cloud",
        "card",
        "compile",
        "shape",
        "batch",
        "token",
        "model",
        "serve",
        "queue",
        "graph",
        "cache",
        "node",
        "pod",
        "kernel",
        "matrix",
        "vector",
        "tensor",
        "scheduler",
        "request",
        "stream",
        "latency",
        "throughput",
    ]
    out = []
    for _ in range(n):
        target = rng.randint(32, 256)
        text = " ".join(rng.choice(words) for _ in range(target * 2))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:target]
        out.append((ids, rng.randint(16, 128)))
    return out


async def run_load(base: str, jobs, concurrency: int, arrivals: list[float] | None = None) -> dict:
    """Streams every job (prompt ids, max_tokens); `arrivals` (seconds from the start) paces them,
    otherwise `concurrency` of them run at once. Returns the summary and per-request records."""
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=1800)
    sem = asyncio.Semaphore(concurrency)
    records: list[dict] = [{} for _ in jobs]
    start = time.perf_counter()

    async def one(i, ids, max_tokens):
        if arrivals is not None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        async with sem:
            t0 = time.perf_counter()
            last, gaps, first, tokens = None, [], None, 0
            stream = await client.completions.create(
                model="smollm2",
                prompt=ids,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    if last is None:
                        first = now - t0
                    else:
                        gaps.append(now - last)
                    last = now
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            records[i] = {"ttft": first, "itl": gaps, "tokens": tokens}

    await asyncio.gather(*(one(i, ids, m) for i, (ids, m) in enumerate(jobs)))
    wall = time.perf_counter() - start
    await client.close()  # inside the loop: closing it after asyncio.run() ends raises "Event loop is closed"
    return {"summary": summarize(records, wall), "records": records}


def summarize(records: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in records if r.get("ttft") is not None]
    itl = [g for r in records for g in r.get("itl", [])]
    tokens = sum(r.get("tokens", 0) for r in records)
    return {
        "requests": len(records),
        "wall_s": wall,
        "output_tokens": tokens,
        "tok_per_s": tokens / wall,
        "req_per_s": len(records) / wall,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(itl, 50),
        "itl_p99": pct(itl, 99),
    }


def hf_baselines(jobs, batch: int, model_dir: Path = MODEL_DIR) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    res = {}
    t0, toks = time.perf_counter(), 0
    with torch.inference_mode():
        for ids, m in jobs:
            model.generate(torch.tensor([ids]), max_new_tokens=m, min_new_tokens=m, do_sample=False)
            toks += m
    res["hf_one_at_a_time"] = {"tok_per_s": toks / (time.perf_counter() - t0), "requests": len(jobs)}
    t0, toks = time.perf_counter(), 0
    with torch.inference_mode():
        for i in range(0, len(jobs), batch):
            group = jobs[i : i + batch]
            width = max(len(ids) for ids, _ in group)
            m = max(mt for _, mt in group)
            input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids, _ in group])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in group])
            model.generate(
                input_ids,
                attention_mask=mask,
                max_new_tokens=m,
                min_new_tokens=m,
                do_sample=False,
                pad_token_id=0,
            )
            toks += sum(
                mt for _, mt in group
            )  # useful tokens only: a static batch runs to its longest request
    res["hf_static_batches_of_8"] = {"tok_per_s": toks / (time.perf_counter() - t0), "requests": len(jobs)}
    return res


def step_overhead(jobs, model_dir: Path = MODEL_DIR, backend: str = "inductor") -> dict:
    """Pure compiled forward of a decode step vs the engine's full step, in process, same shape."""
    from spyre_runtime.config import load_config
    from spyre_runtime.engine.llm_engine import LLMEngine
    from spyre_runtime.sampling.params import SamplingParams

    cfg = load_config(model_dir, environ={"SENDNN_INFERENCE_DYNAMO_BACKEND": backend, **SHAPES})
    engine = LLMEngine(cfg)
    engine.executor.warmup()
    step_times: list[float] = []
    engine.on_step = lambda step, s: step_times.append(s) if not step.is_prefill else None
    group = [ids for ids, _ in jobs if len(ids) <= 256][:8]
    for ids in group:
        engine.add_request(ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    t_steps = []
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        t_steps.append(time.perf_counter() - t0)
    decode_steps = t_steps[1:]
    shape = engine.executor.config.shapes[-1]
    args = engine.executor.inputs.static_decode(shape, [len(i) for i in group], [1] * len(group), 10)
    fwd = []
    for _ in range(30):
        t0 = time.perf_counter()
        engine.executor._run(*args)
        fwd.append(time.perf_counter() - t0)
    step_med, fwd_med = statistics.median(decode_steps), statistics.median(fwd)
    return {
        "engine_decode_step_ms": step_med * 1e3,
        "compiled_forward_ms": fwd_med * 1e3,
        "overhead_pct": 100 * (step_med - fwd_med) / step_med,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--hf-requests", type=int, default=16, help="baselines run on the first N requests")
    ap.add_argument("--cb", action="store_true", help="also serve the workload with continuous batching")
    add_model_args(ap)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model_dir = bench_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    jobs = workload(tok, args.requests)
    name = "SmolLM2-135M" if args.model is None else model_dir.name
    results: dict = {
        "machine": f"{os.cpu_count()} cores, torch {torch.__version__}, {name} fp32, {args.backend}"
    }
    modes = {"spyre_serve": (with_backend(SHAPES, args.backend), ())}
    if args.cb:
        from cb_bench import CB_ARGS, CB_ENV

        modes["spyre_serve_continuous"] = (with_backend(CB_ENV, args.backend), CB_ARGS)
    with work_dir("spyre-serve-bench-", args.logs) as logs:
        for label, (env, extra) in modes.items():
            t0 = time.perf_counter()
            server = ServerProcess(
                model_dir, env, logs / f"{label}.log", served_name="smollm2", extra_args=extra
            )
            try:
                server.wait_ready(timeout=3600)
                ready = time.perf_counter() - t0
                results[label] = asyncio.run(run_load(server.base, jobs, args.concurrency))["summary"]
                results[label]["ready_s"] = ready
            finally:
                server.stop()
    results.update(hf_baselines(jobs[: args.hf_requests], 8, model_dir))
    results["step_overhead"] = step_overhead(jobs, model_dir, args.backend)
    hf1 = results["hf_one_at_a_time"]["tok_per_s"]
    for label in modes:
        results[f"{label}_vs_hf_one_at_a_time"] = results[label]["tok_per_s"] / hf1
    (args.out or REPO / "bench/results-serve.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
