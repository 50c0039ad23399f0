"""Where a serving run's time goes, engine step by engine step: our server alone in the matrix's
configuration (matrix_bench.ours_config), our seeded client at N streams (4 requests a stream), and the
engine's step histogram (`spyre_engine_step_seconds` on /metrics) read before and after each load. With
`--before DIR` (a checkout of an earlier commit), its code serves in turn with this one, alternating
`--rounds` times, each with its own kernel build, so a change of the shared machine's load falls on both.
A script with a report, not a timed test (bench/README.md runs 54 and 55).

    .venv/bin/python bench/step_mix_bench.py [--dtype bfloat16] [--streams 8,32] [--before DIR]
                                             [--rounds 3] [--out FILE]

Prints per load: wall, output tok/s, TTFT p50, the time inside steps (and its share of the wall), and the
mixed and decode steps' counts and mean times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CODE = ("runtime", "contract", ".")  # a checkout's folders on PYTHONPATH
ROOT = Path(__file__).resolve().parent.parent


def steps(base: str) -> dict[str, dict[str, float]]:
    """The engine step histogram's sum and count by kind of step."""
    import httpx

    text = httpx.get(base + "/metrics").text
    out: dict[str, dict[str, float]] = {}
    pattern = r'spyre_engine_step_seconds_(sum|count)\{kind="(\w+)"\} ([0-9.e+-]+)'
    for m in re.finditer(pattern, text):
        out.setdefault(m.group(2), {})[m.group(1)] = float(m.group(3))
    return out


def one_server(code: Path, slot: int, dtype: str, streams: list[int], cache: Path) -> dict:
    """Serves with the checkout `code` (its kernel build in `slot`), runs every load; the figures of each."""
    from serve_bench import run_load, workload
    from transformers import AutoTokenizer
    from variants_ab import argv_env
    from vllm_bench import MODEL_DIR, Server, free_port

    port = free_port()
    argv, env = argv_env("ours", {}, port, dtype, Path(sys.executable), cache)  # the matrix's configuration
    env |= {
        "TORCH_EXTENSIONS_DIR": str(cache / f"extensions-{slot}"),  # each checkout's own kernel build
        "PYTHONPATH": os.pathsep.join(str(code / part) for part in CODE),
    }
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    base = f"http://127.0.0.1:{port}"
    (cache / "logs").mkdir(parents=True, exist_ok=True)
    server = Server("ours", argv, env, cache / "logs")
    result: dict = {"code": str(code)}
    try:
        result["ready_s"] = round(server.wait_ready(base), 1)
        asyncio.run(run_load(base, workload(tokenizer, 1, seed=9), concurrency=1))  # first request: warm
        for n in streams:
            before = steps(base)
            start = time.perf_counter()
            summary = asyncio.run(run_load(base, workload(tokenizer, 4 * n, seed=0), concurrency=n))[
                "summary"
            ]
            wall = time.perf_counter() - start
            after = steps(base)
            kinds = {
                kind: {x: after[kind].get(x, 0) - before.get(kind, {}).get(x, 0) for x in ("sum", "count")}
                for kind in after
            }
            busy = sum(v["sum"] for v in kinds.values())
            row = {
                "wall_s": round(wall, 2),
                "tok_per_s": round(summary["tok_per_s"], 1),
                "ttft_p50_ms": round(1e3 * summary["ttft_p50"], 1),
                "busy_s": round(busy, 2),
            }
            row |= {k: {"steps": int(v["count"]), "mean_ms": round(1e3 * v["sum"] / max(v["count"], 1), 1)}
                    for k, v in kinds.items()}  # fmt: skip
            result[f"c{n}"] = row
            print(
                f"{code.name} c{n}: wall {wall:.1f} s, {row['tok_per_s']} tok/s, "
                f"TTFT p50 {row['ttft_p50_ms']} ms, in steps {busy:.1f} s "
                f"({busy / wall:.0%}), "
                + ", ".join(
                    f"{k} {v['steps']} x {v['mean_ms']} ms" for k, v in row.items() if isinstance(v, dict)
                ),
                flush=True,
            )
    finally:
        server.stop()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--streams", default="8,32")
    ap.add_argument(
        "--before", type=Path, default=None, help="a checkout of an earlier commit, served in turn"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.before is not None and not (args.before / "runtime" / "spyre_runtime").is_dir():
        print(f"--before {args.before}: not a checkout of this project", file=sys.stderr)
        return 2
    streams = [int(n) for n in args.streams.split(",")]
    codes = [args.before.resolve(), ROOT] if args.before else [ROOT]
    results = []
    with tempfile.TemporaryDirectory(prefix="step-mix-") as folder:
        for _ in range(args.rounds):
            for slot, code in enumerate(codes):
                results.append(one_server(code, slot, args.dtype, streams, Path(folder)))
    text = json.dumps({"dtype": args.dtype, "streams": streams, "runs": results}, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
