"""How far each serving cell of a matrix run (matrix_bench.py) is from what this machine's GEMMs allow.
A cell's work is its workload's linear-layer FLOPs on SmolLM2-135M, the same for both systems: the 30 layers
for every token the model reads, the LM head for every token it scores (each prompt's last, each later
output token); the attention's few percent are left out. Each system's rate is that work over its wall
time, against a large GEMM's rate measured here (torch.mm, 2048 x 2048, the fastest of 20 calls: another
hour's matrix is priced against this hour's cores). `needed` is the rate ours would need for `--target` x
vLLM's throughput. A script with a report, not a timed test (bench/README.md run 58).

    .venv/bin/python bench/ceiling_bench.py bench/results-matrix-zen4-r57.json [--target 1.2] [--out FILE]

Our client's cells are serve_bench.workload's seeded prompts (their tokens counted as the bench cuts them,
checked against the output tokens the run recorded); vLLM's client's, the totals it reported.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_attention_bench import write_results
from row_linear_bench import HIDDEN, LAYERS, SHAPES, VOCAB
from serve_bench import workload

LAYER_FLOPS = 2 * LAYERS * sum(n * k for n, k in SHAPES)  # a token through the 30 layers' linear layers
HEAD_FLOPS = 2 * VOCAB * HIDDEN  # a token scored by the LM head


def gemm_rate(dtype: torch.dtype, n: int = 2048, iters: int = 20) -> float:
    """FLOP/s of torch.mm on two n x n matrices, the fastest of `iters` calls: what the cores do when the
    shared machine lets them (a noisy minute only slows a call down)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times)


def words(text: str, add_special_tokens: bool = False) -> dict:
    """A tokenizer for counting serve_bench's prompts: it makes twice the words a prompt keeps, so every
    tokenizer that gives a word at least one token cuts the same number."""
    return {"input_ids": text.split()}


def cell_work(cell: str, ours: dict) -> tuple[int, int, int]:
    """(prompt tokens, output tokens, requests) of a cell, from what ours recorded for it."""
    if cell.startswith("vllm_client"):
        return ours["total_input_tokens"], ours["total_output_tokens"], ours["completed"]
    jobs = workload(words, ours["requests"])
    outputs = sum(m for _, m in jobs)
    if outputs != ours["output_tokens"]:
        raise SystemExit(
            f"{cell}: the seeded workload has {outputs} output tokens, the run had {ours['output_tokens']}"
        )
    return sum(len(ids) for ids, _ in jobs), outputs, len(jobs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("matrix", type=Path, help="a matrix_bench.py result with both systems")
    ap.add_argument("--target", type=float, default=1.2, help="ours / vLLM's throughput to price")
    ap.add_argument("--gemm-size", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    matrix = json.loads(args.matrix.read_text())
    results: dict = {"matrix": args.matrix.name, "target": args.target, "threads": torch.get_num_threads()}
    for dtype in ("float32", "bfloat16"):
        if "vllm" not in matrix.get(dtype, {}):
            continue
        peak = gemm_rate(getattr(torch, dtype), args.gemm_size)
        rows = {"gemm_gflops": round(peak / 1e9, 1)}
        for cell, ours in matrix[dtype]["ours"].items():
            peer = matrix[dtype]["vllm"].get(cell)
            if not cell.startswith(("c", "vllm_client_c")) or cell == "c1" or not isinstance(peer, dict):
                continue
            prompts, outputs, requests = cell_work(cell, ours)
            flops = (
                prompts * LAYER_FLOPS
                + requests * HEAD_FLOPS
                + (outputs - requests) * (LAYER_FLOPS + HEAD_FLOPS)
            )
            wall = {name: r.get("duration", r.get("wall_s")) for name, r in (("ours", ours), ("vllm", peer))}
            rate = {name: flops / s for name, s in wall.items()}
            needed = args.target * rate["vllm"]
            rows[cell] = {
                "tflop": round(flops / 1e12, 2),
                "ours_gflops": round(rate["ours"] / 1e9, 1),
                "vllm_gflops": round(rate["vllm"] / 1e9, 1),
                "ours_of_gemm": round(rate["ours"] / peak, 3),
                "vllm_of_gemm": round(rate["vllm"] / peak, 3),
                "needed_of_gemm": round(needed / peak, 3),
            }
            print(
                f"{dtype} {cell}: {flops / 1e12:.2f} TFLOP; ours {rate['ours'] / 1e9:.0f} GFLOP/s "
                f"({rate['ours'] / peak:.0%} of the GEMM's {peak / 1e9:.0f}), vLLM {rate['vllm'] / 1e9:.0f} "
                f"({rate['vllm'] / peak:.0%}); {args.target}x vLLM needs {needed / peak:.0%}",
                flush=True,
            )
        results[dtype] = rows
    if not any(dtype in results for dtype in ("float32", "bfloat16")):
        raise SystemExit(f"{args.matrix}: no dtype with both systems' cells to price (--systems ours only?)")
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
