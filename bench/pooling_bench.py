"""Embeddings per second of all-MiniLM-L6-v2: spyre-serve's pooling runtime against sentence-transformers,
at batch 1 and batch 32, on the same machine in the same run. A script with a report, not a timed test.

    .venv/bin/python bench/pooling_bench.py [--rounds 3] [--backends inductor,eager] [--model DIR]
                                            [--out bench/results-pooling.json]

In process: sentence-transformers `encode` (batch_size 1 and 32; it pads each batch to its longest input)
(batch 1 over the first 16 texts, batch 32 over all 64)
against our FMS encoder at the static shapes (64, 1) and (64, 32), compiled with inductor (weights frozen) and
eager. Through the server: `spyre-runtime serve` (inductor, the same two shapes) with the official openai
client: one request of 32 inputs, and 32 concurrent one-input requests (batched across requests by the
engine), against the same 32 inputs sent one request at a time. The rounds are interleaved; medians are
reported. Writes bench/results-pooling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = Path.home() / ".cache/spyre-serve/models/minilm"
VOCABULARY = (
    "the model serves embeddings for retrieval pipelines on accelerator cards while a scheduler batches "
    "requests into static shapes compiled at start up so that nothing compiles during serving and every "
    "query finds its nearest documents in a vector index of product manuals support tickets and code"
)
WORDS = VOCABULARY.split(" ")
NUM_TEXTS = 64
BATCH1_TEXTS = 16  # batch-1 cases embed the first 16 texts one at a time
PORT = 17461


def workload(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) for _ in range(NUM_TEXTS)]


def rate(fn, n: int) -> float:
    t0 = time.perf_counter()
    fn()
    return n / (time.perf_counter() - t0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads, for both sides and the server (1: on this shared machine two threads under "
        "load ran 10x slower than one, spinning against other processes)",
    )
    parser.add_argument(
        "--backends", default="inductor,eager", help="ours, in process; the server runs the first"
    )
    parser.add_argument("--model", type=Path, default=None, help="a sentence-transformers folder, not MiniLM")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results-pooling.json")
    args = parser.parse_args()
    backends = args.backends.split(",")
    sys.path.insert(0, str(REPO / "runtime"))
    import torch

    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer
    from spyre_contract import Shape
    from spyre_runtime.config import RuntimeConfig
    from spyre_runtime.executor.families.pooling import PoolingModel, detect_pooling
    from spyre_runtime.testing.models import prepare_minilm
    from transformers import AutoTokenizer

    model_dir = args.model or prepare_minilm(MODEL_DIR)
    load_start = round(os.getloadavg()[0], 1)
    texts = workload()
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(texts)
    rows = [(ids, enc["token_type_ids"][i]) for i, ids in enumerate(enc["input_ids"])]
    lengths = [len(ids) for ids, _ in rows]
    assert max(lengths) <= 64, max(lengths)
    st = SentenceTransformer(str(model_dir), device="cpu")
    spec = detect_pooling(model_dir)
    one, wide = Shape(64, 0, 1), Shape(64, 0, 32)
    models = {}
    for backend in backends:
        config = RuntimeConfig(
            model_dir=model_dir, served_model_name="m", backend=backend, shapes=(one, wide)
        )
        model = PoolingModel(config, spec, tok.pad_token_id)
        t0 = time.perf_counter()
        model.warmup()
        models[backend] = (model, time.perf_counter() - t0)

    reference = st.encode(texts, convert_to_tensor=True, batch_size=32)
    ours = torch.cat([models[backends[0]][0].run(wide, rows[i : i + 32]) for i in range(0, NUM_TEXTS, 32)])
    max_diff = (ours - reference).abs().max().item()

    def run_ours(model, batch: int):
        shape = one if batch == 1 else wide
        count = BATCH1_TEXTS if batch == 1 else NUM_TEXTS
        return lambda: [model.run(shape, rows[i : i + batch]) for i in range(0, count, batch)], count

    def run_st(batch: int):
        count = BATCH1_TEXTS if batch == 1 else NUM_TEXTS
        return lambda: st.encode(texts[:count], batch_size=batch, convert_to_tensor=True), count

    cases = {
        "sentence-transformers batch 1": run_st(1),
        "sentence-transformers batch 32": run_st(32),
        **{
            f"spyre-serve {backend} batch {batch}": run_ours(models[backend][0], batch)
            for backend in backends
            for batch in (1, 32)
        },
    }
    for fn, _ in cases.values():
        fn()  # one untimed pass each
    in_process: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (fn, count) in cases.items():
            in_process[name].append(rate(fn, count))
        print({k: round(v[-1], 1) for k, v in in_process.items()}, flush=True)
    served, startup = serve_rates(texts[:32], args.rounds, args.threads, model_dir, backends[0])
    print(served, flush=True)

    def med(values: list[float]) -> float:
        return round(statistics.median(values), 1)

    results = {
        "machine": f"{os.cpu_count()} vCPUs, {platform.machine()}, torch {torch.__version__}",
        "load_average_start_end": [load_start, round(os.getloadavg()[0], 1)],
        "threads": torch.get_num_threads(),
        "model": f"{'all-MiniLM-L6-v2' if args.model is None else model_dir.name} (fp32)",
        "texts": NUM_TEXTS,
        "tokens_min_mean_max": [min(lengths), round(sum(lengths) / len(lengths), 1), max(lengths)],
        "max_abs_diff_vs_sentence_transformers": max_diff,
        "warmup_seconds_two_shapes": {backend: round(s, 1) for backend, (_, s) in models.items()},
        "in_process_embeddings_per_second": {k: med(v) for k, v in in_process.items()},
        "in_process_rounds": {k: [round(x, 1) for x in v] for k, v in in_process.items()},
        "served_embeddings_per_second": {k: med(v) for k, v in served.items()},
        "served_rounds": {k: [round(x, 1) for x in v] for k, v in served.items()},
        "server_startup_seconds": round(startup, 1),
    }
    ip = results["in_process_embeddings_per_second"]
    results["ratios"] = {
        f"batch {batch}: {backends[0]} / sentence-transformers": round(
            ip[f"spyre-serve {backends[0]} batch {batch}"] / ip[f"sentence-transformers batch {batch}"], 2
        )
        for batch in (1, 32)
    }
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


def serve_rates(
    texts: list[str], rounds: int, threads: int, model_dir: Path = MODEL_DIR, backend: str = "inductor"
) -> tuple[dict[str, list[float]], float]:
    """Starts `spyre-runtime serve` (`backend`, shapes (64, 1) and (64, 32)) and measures through HTTP."""
    import httpx
    import openai

    env = {
        **os.environ,
        "SENDNN_INFERENCE_DYNAMO_BACKEND": backend,
        "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64,64",
        "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "1,32",
        "HF_HUB_OFFLINE": "1",
        "SENDNN_INFERENCE_NUM_CPUS": str(threads),
    }
    argv = [sys.executable, "-m", "spyre_runtime.cli", "serve", str(model_dir), "--port", str(PORT)]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            t0 = time.perf_counter()
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"server exited:\n{log.read().decode()[-3000:]}")
                try:
                    if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            startup = time.perf_counter() - t0
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="x", max_retries=0)

            def one_request() -> None:
                client.embeddings.create(model="minilm", input=texts)

            def sequential() -> None:
                for text in texts:
                    client.embeddings.create(model="minilm", input=text)

            def concurrent() -> None:
                with ThreadPoolExecutor(len(texts)) as pool:
                    list(pool.map(lambda t: client.embeddings.create(model="minilm", input=t), texts))

            cases = {
                "one request of 32 inputs": one_request,
                "32 concurrent one-input requests": concurrent,
                "32 one-input requests, one at a time": sequential,
            }
            rates: dict[str, list[float]] = {name: [] for name in cases}
            try:
                for fn in cases.values():
                    fn()
                for _ in range(rounds):
                    for name, fn in cases.items():
                        rates[name].append(rate(fn, len(texts)))
            except openai.APIError as e:
                log.seek(0)
                tail = log.read().decode()[-3000:]
                raise SystemExit(f"{type(e).__name__}: {e}; the server's log:\n{tail}") from e
            return rates, startup
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
