"""Several configurations of ours and of vLLM's CPU build in one run: every server up at once, then each phase
on each server in turn, so a change of the shared machine's load falls on all of them. A script with a
report, not a timed test (bench/README.md runs 46 and 47). Each phase starts with the next variant in turn.

    .venv/bin/python bench/variants_ab.py --dtype bfloat16 --out results.json \
        --variants '{"ours": {}, "ours-spec3": {"spec": 3}, "vllm": {}, "vllm-ngram3": {"spec": 3}}' \
        [--phases c1,c8,v8,c32,v32] [--rounds 1] [--cache-dir DIR]

A variant named `vllm...` is vLLM (`spec`: its `ngram` speculative method with that many tokens, prompt
lookup 2 to 4); any other is ours with the bench's configuration (matrix_bench.ours_config: 32 sequences,
max-model-len 1024, 2,048-token chunks; `pieces`, default 4; `wave`, default 1; `spec`, our
SENDNN_INFERENCE_CB_NGRAM_SPEC_TOKENS, default 0; `env`, variables added to the server's). Phases: `cN`,
our seeded client at N streams (4 requests a stream; `c1`, 4 requests one at a time); `vN`, vLLM's client
(`vllm bench serve`) at N streams, 6 prompts a stream. Each phase also records the CPU seconds and the minor
page faults of the server's processes (its engine core's included). `--rounds R`: every phase R times, round r
with both clients' seed r (round 0 is the single run's workload), and a phase's result is then a list.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import matrix_bench
import vllm_bench
from serve_bench import run_load, workload
from vllm_bench import VLLM_ENV, Server, ensure_vllm_venv, free_port, latency_summary, vllm_argv

OUR_KEYS = ("tok_per_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tpot_p50")
VLLM_KEYS = (
    "output_throughput",
    "median_ttft_ms",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "p99_itl_ms",
)


def argv_env(name: str, variant: dict, port: int, dtype: str, python: Path, caches: Path):
    """The command line and environment of one variant."""
    if name.startswith("vllm"):
        env = {
            **VLLM_ENV,
            "VLLM_CACHE_ROOT": str(caches / name),
            "TORCHINDUCTOR_CACHE_DIR": str(caches / f"ind-{name}"),
        }
        argv = vllm_argv(python, port, dtype)
        if variant.get("spec"):
            method = {"method": "ngram", "num_speculative_tokens": variant["spec"]}
            argv += [
                "--speculative-config",
                json.dumps(method | {"prompt_lookup_max": 4, "prompt_lookup_min": 2}),
            ]
        return argv, env
    config = argparse.Namespace(
        max_model_len=1024,
        mixed_prefill_tokens=0,
        prefill_pieces=variant.get("pieces", 4),
        step_budget_ms=0,
        kv_cache_dtype="auto",
        step_cost_us="",
        chunk=2048,
        wave_start=bool(variant.get("wave", 1)),
        ngram_spec_tokens=variant.get("spec", 0),
    )
    env, flags = matrix_bench.ours_config(config)
    env |= {"TORCHINDUCTOR_CACHE_DIR": str(caches / f"ind-{name}"), **variant.get("env", {})}
    return matrix_bench.ours_argv(port, dtype, flags), env


def tree_usage(pid: int) -> tuple[float, int]:
    """CPU seconds and minor faults of a process and its descendants so far (from /proc)."""
    stats = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        stats[int(stat.parent.name)] = (int(fields[1]), int(fields[7]), int(fields[11]) + int(fields[12]))
    tree, grown = {pid}, True
    while grown:
        children = {p for p, (parent, _, _) in stats.items() if parent in tree} - tree
        tree, grown = tree | children, bool(children)
    members = [stats[p] for p in tree if p in stats]
    return sum(m[2] for m in members) / os.sysconf("SC_CLK_TCK"), sum(m[1] for m in members)


def phase(name: str, base: str, tok, python: Path, log_dir: Path, server: Server, seed: int = 0) -> dict:
    streams = int(name[1:])
    cpu0, faults0 = tree_usage(server.proc.pid)
    if name.startswith("v"):
        result = matrix_bench.vllm_client(python, base, log_dir, streams, 6 * streams, seed=seed)
        summary = {k: result[k] for k in VLLM_KEYS}
    else:
        result = asyncio.run(run_load(base, workload(tok, 4 * streams, seed=seed), concurrency=streams))
        summary = {**result["summary"], **latency_summary(result["records"])}
        summary = {k: summary[k] for k in OUR_KEYS}
    cpu1, faults1 = tree_usage(server.proc.pid)
    return summary | {"server_cpu_s": round(cpu1 - cpu0, 2), "server_minor_faults": faults1 - faults0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--variants", required=True, help="JSON: name -> settings")
    ap.add_argument("--phases", default="c1,c8,v8,c32,v32")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/spyre-serve/variants-ab")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    caches = args.cache_dir / args.dtype
    caches.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(vllm_bench.MODEL_DIR)
    python = ensure_vllm_venv()
    servers, results = {}, {"machine": matrix_bench.machine(), "dtype": args.dtype}
    try:
        for name, variant in json.loads(args.variants).items():
            port = free_port()
            argv, env = argv_env(name, variant, port, args.dtype, python, caches)
            server = Server(name, argv, env, caches)
            servers[name] = (server, f"http://127.0.0.1:{port}")
            results[name] = {"settings": variant, "ready_s": server.wait_ready(servers[name][1])}
            print(f"{name}: ready in {results[name]['ready_s']:.1f} s", flush=True)
            asyncio.run(run_load(servers[name][1], workload(tok, 1, seed=9), concurrency=1))
        names = list(servers)
        phases = [(r, ph) for r in range(args.rounds) for ph in args.phases.split(",")]
        for k, (r, ph) in enumerate(phases):
            for name in names[k % len(names) :] + names[: k % len(names)]:  # each phase starts with another
                server, base = servers[name]
                time.sleep(matrix_bench.PHASE_PAUSE_S)
                result = phase(ph, base, tok, python, caches, server, seed=r)
                if args.rounds == 1:
                    results[name][ph] = result
                else:
                    results[name].setdefault(ph, []).append(result)
                print(name, ph, r, json.dumps(result), flush=True)
    finally:
        for server, _ in servers.values():
            server.stop()
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
