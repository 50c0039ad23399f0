"""Where the time of one continuous-batching step goes: a decode step at batch 8 and one prefill chunk,
through the runtime's own ModelExecutor on SmolLM2 (inductor). A script with a report, not a timed test.

    .venv/bin/python bench/profile_step.py [--batch 8] [--live N] [--kv 256] [--chunk 256] [--dtype float32]
                                           [--kv-cache-dtype auto] [--iters 20] [--kernel 1] [--out FILE]
                                           [--model DIR]

Prints the median time of the compiled forward and of the whole executor step (inputs built, forward,
sampling), and torch.profiler's top operators for both. The chunk runs as a mixed step (the chunk and the
decode rows in one forward, as serving runs it). `--kernel 0` runs the paged decode attention on its ATen
ops instead of the C++ kernel (SENDNN_INFERENCE_PAGED_ATTENTION_KERNEL); `attention_*` report the paged
attention ops' inclusive time per step and their share of the profiled step. With
`TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1` and a fresh `TORCHINDUCTOR_CACHE_DIR` (so that the graphs compile
again), each of inductor's C++ kernels is a row of its own (run 31 found the rotary embedding's so).
`--live N`: the decode step's first N rows only are live (linear.live_rows), as one stream decodes in the
8-row graph of a server. Run it without `OMP_WAIT_POLICY=PASSIVE` (make test's setting): sleeping OpenMP
threads wake for each of a step's parallel regions, and the 8-row step with one live row took 30.4 ms so
against 16.5 ms (run 31).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from serve_bench import MODEL_DIR  # noqa: E402


def timed(fn, iters: int, paths: dict | None = None) -> float | dict:
    """The median ms of `fn`; with `paths` (name -> context), per path, the paths alternating each
    iteration so that a change of the shared machine's load falls on all of them."""
    if paths is None:
        return timed(fn, iters, {"": contextlib.nullcontext})[""]
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(iters):
        for name, context in paths.items():
            with context():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


ATTENTION_OPS = ("spyre_serve::paged_decode", "spyre_serve::paged_prefill")


def top_ops(fn, rows: int = 12) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        step_ms = (time.perf_counter() - t0) / 3e-3
    averages = prof.key_averages()
    events = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
    attention = {e.key: e.cpu_time_total / 3e3 for e in averages if e.key in ATTENTION_OPS}
    return {
        "profiled_step_ms": step_ms,
        "attention_ms_per_step": attention,
        "attention_share": sum(attention.values()) / step_ms,
        "ops": [
            {"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 3e3, "calls_per_step": e.count / 3}
            for e in events[:rows]
        ],
    }


def _cpu() -> dict:
    """The CPU's model name and its vector ISA flags (/proc/cpuinfo)."""
    info = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and "model" not in info:
                info["model"] = value.strip()
            if key.strip() == "flags" and "flags" not in info:
                wanted = ("avx", "amx", "fma", "vnni", "bf16", "fp16", "vsx", "sve", "asimd")
                info["flags"] = sorted({f for f in value.split() if f.startswith(wanted)})
    return info


def warm_executor(
    batch: int,
    kv: int,
    chunk: int,
    dtype: str,
    kv_cache_dtype: str = "auto",
    backend: str = "inductor",
    model: Path | None = None,
):
    """The runtime's ModelExecutor on `model` (SmolLM2 when None) with one decode graph of `batch` rows,
    warmed up (its graphs compiled); (executor, load seconds, warm-up seconds). This bench's and
    floor_bench.py's."""
    from spyre_runtime.config import load_config
    from spyre_runtime.executor.model_executor import ModelExecutor

    env = {
        "SENDNN_INFERENCE_DYNAMO_BACKEND": backend,
        "SENDNN_INFERENCE_USE_CB": "1",
        "SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES": str(batch),
        "SENDNN_INFERENCE_CB_KV_LENS": str(kv),
        "SENDNN_INFERENCE_DTYPE": dtype,
        "SENDNN_INFERENCE_KV_CACHE_DTYPE": kv_cache_dtype,
    }
    if model is None:
        from spyre_runtime.testing.models import prepare_smollm2

        prepare_smollm2(MODEL_DIR)
    cfg = load_config(
        model or MODEL_DIR, environ=env, max_num_seqs=batch, max_model_len=kv, max_num_batched_tokens=chunk
    )
    t0 = time.perf_counter()
    ex = ModelExecutor(cfg)
    load_s = time.perf_counter() - t0
    return ex, load_s, ex.warmup()


def decode_step(batch: int, kv: int, rows: int | None = None):
    """A decode step in the graph of `batch` rows with its first `rows` (all when None) filled: row r at
    position kv / 2 + r, its own kv / 64 blocks."""
    from spyre_runtime.steps import ContinuousStep, DecodeRow

    nb = kv // 64
    filled = tuple(
        DecodeRow(
            request=None,
            token_id=100 + r,
            position=kv // 2 + r,
            block_table=tuple(range(1 + r * nb, 1 + (r + 1) * nb)),
        )
        for r in range(batch if rows is None else rows)
    )
    return ContinuousStep(batch_size=batch, kv_len=kv, decode=filled)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--live", type=int, default=None, help="the decode step's live rows (default: all)")
    ap.add_argument("--kv", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's dtype (auto: the model's)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument(
        "--kernel",
        choices=("0", "1", "both"),
        default="both",
        help="the paged decode attention on the C++ kernel (1), its ATen ops (0), or both alternating",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--model", type=Path, default=None, help="a model folder instead of SmolLM2")
    args = ap.parse_args()
    os.environ["SENDNN_INFERENCE_PAGED_ATTENTION_KERNEL"] = "0" if args.kernel == "0" else "1"
    import dataclasses

    from spyre_runtime.executor.kernels import paged_attention
    from spyre_runtime.steps import PrefillChunk

    ex, load_s, warm_s = warm_executor(
        args.batch, args.kv, args.chunk, args.dtype, args.kv_cache_dtype, args.backend, args.model
    )
    nb = args.kv // 64
    decode = decode_step(args.batch, args.kv)
    chunk = PrefillChunk(None, tuple(range(1, args.chunk + 1)), 0, args.chunk, tuple(range(1, 1 + nb)), True)
    decode_args = ex.inputs.batch_decode(decode)
    # chunks run beside the decode rows (mixed steps, SENDNN_INFERENCE_CP_INTERLEAVE_STEPS=1, the default)
    mixed = dataclasses.replace(decode, chunks=(chunk,), mixed=True, pieces=ex.config.prefill_pieces)
    chunk_args = ex.inputs.mixed(mixed)
    paths = {"aten": paged_attention.disabled, "kernel": contextlib.nullcontext}
    if args.kernel != "both":
        paths = {"kernel" if args.kernel == "1" else "aten": contextlib.nullcontext}
    if "kernel" in paths and paged_attention.kernel() is None:
        raise SystemExit("the paged attention kernel did not build (see the warning above)")

    def decode_forward():
        return ex.run_local(*decode_args, live_rows=args.live)

    def profiled(fn):
        result = {}
        for name, context in paths.items():
            with context():
                result[name] = top_ops(fn)
        return result

    res = {
        "config": vars(args) | {"out": None, "model": str(args.model or MODEL_DIR)},
        "cpu": _cpu(),
        "load_s": load_s,
        "warmup_s": warm_s,
        "decode_forward_ms": timed(decode_forward, args.iters, paths),
        "decode_inputs_ms": timed(lambda: ex.inputs.batch_decode(decode), args.iters),
        "chunk_forward_ms": timed(lambda: ex.run_local(*chunk_args), max(3, args.iters // 4), paths),
        "chunk_inputs_ms": timed(lambda: ex.inputs.mixed(mixed), args.iters),
        "decode_top_ops": profiled(decode_forward),
        "chunk_top_ops": profiled(lambda: ex.run_local(*chunk_args)),
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
        from charts import chart_beside

        chart_beside(args.out)  # the top ops per step, as a PNG beside the JSON
    return 0


if __name__ == "__main__":
    sys.exit(main())
