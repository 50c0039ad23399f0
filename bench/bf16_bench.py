"""Where a bf16 decode step goes against a float32 one, op by op (issue 38's "bf16 that is faster than
fp32"): the GEMMs of SmolLM2's decode step (30 layers x 7 linear layers and the LM head, as the runtime runs
them: oneDNN on weights packed once, `linear.py`) and the paged decode attention of its 30 layers (the C++
kernel, `executor/kernels`), at 1, 8 and 32 rows, both dtypes in one process, alternating every iteration so
that the shared machine's load falls on both. A script with a report, not a timed test.

    .venv/bin/python bench/bf16_bench.py [--rows 1,8,32] [--iters 9] [--kv 256] [--out FILE]

Also the plain bf16 GEMM (F.linear: oneDNN's matmul on the unpacked weight) and the oneDNN kernel each path
runs: a child process with ONEDNN_VERBOSE=1 names the implementation (`brg_matmul:avx512_core_bf16`,
`...:avx512_core_amx`, ...), i.e. whether bf16 reaches AVX-512 bf16 or AMX on this CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HIDDEN, INTER, VOCAB, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 49152, 30, 9, 3, 64
LAYER_SHAPES = [(HIDDEN, HIDDEN), (192, HIDDEN), (192, HIDDEN), (HIDDEN, HIDDEN)]  # q, k, v, o
LAYER_SHAPES += [(INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]  # gate, up, down

VERBOSE_CHILD = """
import torch
for dtype in (torch.float32, torch.bfloat16):
    w = torch.randn(1536, 576, dtype=dtype)
    packs = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 32) if packs else None
    for rows in (1, 8, 32):
        x = torch.randn(rows, 576, dtype=dtype)
        print("PATH packed", dtype, rows, flush=True)
        if packs:
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        else:
            print("UNSUPPORTED", flush=True)
        print("PATH plain", dtype, rows, flush=True)
        torch.nn.functional.linear(x, w)
"""


def onednn_kernels() -> dict:
    """path -> the oneDNN implementation it ran (none: not oneDNN, e.g. MKL's sgemm for a plain fp32 GEMM)."""
    out = subprocess.run(
        [sys.executable, "-c", VERBOSE_CHILD],
        env={**os.environ, "ONEDNN_VERBOSE": "1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found: dict = {}
    path = None
    for line in out.splitlines():
        if line.startswith("PATH "):
            path = line[5:]
            found[path] = "not oneDNN"
        elif line == "UNSUPPORTED":
            found[path] = "unsupported (oneDNN cannot pack bf16 on this CPU: the runtime runs the plain GEMM)"
        elif path and ",exec,cpu," in line and ",reorder," not in line:
            fields = line.split(",")
            found[path] = f"{fields[5]} {fields[6]}"
    isa = re.search(r"info,cpu,isa:(.*)", out)
    return {"isa": isa.group(1) if isa else "unknown", "kernels": found}


def gemms(dtype: torch.dtype, rows: int, packed: bool):
    """One decode step's GEMMs: a callable running them all."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).to(dtype) * 0.02 for o, i in LAYER_SHAPES] * LAYERS
    weights.append(torch.randn(VOCAB, HIDDEN, generator=gen).to(dtype) * 0.02)
    inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (HIDDEN, INTER)}
    if packed:
        pairs = [(inputs[w.shape[1]], torch.ops.mkldnn._reorder_linear_weight(w, 32)) for w in weights]

        def run():
            for x, p in pairs:
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

        return run
    pairs = [(inputs[w.shape[1]], w) for w in weights]

    def run_plain():
        for x, w in pairs:
            torch.nn.functional.linear(x, w)

    return run_plain


def attention(dtype: torch.dtype, rows: int, kv: int):
    """One decode step's paged attention: the kernel over each of the 30 layers' caches."""
    from spyre_runtime.executor import kv_cache

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from paged_attention_bench import case_inputs

    inputs = case_inputs(rows, HEADS, KV_HEADS, HEAD_DIM, kv, dtype)

    def run():
        for _ in range(LAYERS):
            kv_cache.paged_decode(*inputs)

    return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--kv", type=int, default=256, help="context tokens per row (ragged: 80-100 %)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from spyre_runtime.executor.kernels import paged_attention

    if paged_attention.kernel() is None:
        raise SystemExit("the paged attention kernel did not build (see the warning above)")
    # where oneDNN cannot pack bf16 (an AVX2 CPU: no AVX-512 BW/VL/DQ, no AVX-NE-CONVERT), the runtime runs
    # bf16 on the plain GEMM (linear.can_pack), and so does the bench's bf16 arm
    bf16_packs = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    res: dict = {
        "onednn": onednn_kernels(),
        "threads": torch.get_num_threads(),
        "bf16_packs": bf16_packs,
        "rows": {},
    }
    print(json.dumps(res["onednn"], indent=1), flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        arms = {
            "gemm fp32 packed": gemms(torch.float32, rows, True),
            "gemm bf16 packed": gemms(torch.bfloat16, rows, True) if bf16_packs else None,
            "gemm bf16 plain": gemms(torch.bfloat16, rows, False),
            "attention fp32": attention(torch.float32, rows, args.kv),
            "attention bf16": attention(torch.bfloat16, rows, args.kv),
        }
        arms = {name: fn for name, fn in arms.items() if fn is not None}
        times: dict = {name: [] for name in arms}
        for fn in arms.values():
            fn()
        for _ in range(args.iters):
            for name, fn in arms.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        bf16 = med["gemm bf16 packed"] if bf16_packs else med["gemm bf16 plain"]
        med["gemm bf16 / fp32"] = bf16 / med["gemm fp32 packed"]
        med["attention bf16 / fp32"] = med["attention bf16"] / med["attention fp32"]
        res["rows"][rows] = med
        print(rows, json.dumps({k: round(v, 3) for k, v in med.items()}), flush=True)
    res["load_average"] = os.getloadavg()
    if args.out:
        args.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
