"""Tensor parallelism on a tiny model whose heads divide (8 heads, 4 KV heads): greedy outputs at N = 2 equal
N = 1 for static and continuous batching; a model whose heads do not divide is refused with both numbers; a
worker that dies takes the server down with a non-zero exit and leaves no process behind; SIGTERM stops
every rank."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import psutil
import pytest
from spyre_runtime.config import ConfigError, RuntimeConfig, Shape
from spyre_runtime.engine.llm_engine import LLMEngine
from spyre_runtime.executor.workers import check_tensor_parallel
from spyre_runtime.sampling.params import SamplingParams
from spyre_runtime.testing.models import write_tiny_model

from tests.runtime.serverproc import ServerProcess

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(20, 90)), [42] * 30]


@pytest.fixture(scope="module")
def model_8_4(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-8-4"), heads=8, kv_heads=4, seed=3)


@pytest.fixture(scope="module")
def model_9_3(tmp_path_factory):
    # SmolLM2's head counts (9 attention heads, 3 KV heads), at a tiny size
    return write_tiny_model(tmp_path_factory.mktemp("tiny-9-3"), hidden=72, heads=9, kv_heads=3, seed=4)


def run(config: RuntimeConfig) -> list[list[int]]:
    engine = LLMEngine(config)
    try:
        engine.executor.warmup()
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        reqs = [engine.add_request(p, params) for p in PROMPTS]
        while engine.has_work():
            engine.step()
        return [r.output_token_ids for r in reqs]
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["static", "continuous"])
def test_greedy_outputs_at_two_ranks_equal_one_rank(model_8_4, mode):
    if mode == "static":
        base = RuntimeConfig(
            model_dir=model_8_4, served_model_name="t", backend="eager", shapes=(Shape(128, 10, 4),)
        )
    else:
        base = RuntimeConfig(
            model_dir=model_8_4,
            served_model_name="t",
            backend="eager",
            use_cb=True,
            max_model_len=128,
            max_num_seqs=2,
            max_num_batched_tokens=64,
        )
    alone = run(base)
    # one load slot on the host: the ranks load one after the other and still meet (no deadlock)
    assert run(replace(base, tensor_parallel_size=2, max_load_processes=1)) == alone
    time.sleep(0.5)
    assert ranks_of(psutil.Process()) == []  # rank 1 exited with the engine


def test_heads_must_divide(model_8_4, model_9_3):
    def cfg(model, n):
        return RuntimeConfig(model_dir=model, served_model_name="t", tensor_parallel_size=n)

    check_tensor_parallel(cfg(model_8_4, 2))
    check_tensor_parallel(cfg(model_8_4, 4))
    check_tensor_parallel(cfg(model_9_3, 3))
    with pytest.raises(ConfigError, match=r"attention heads \(9\) and KV heads \(3\)"):
        check_tensor_parallel(cfg(model_9_3, 2))
    with pytest.raises(ConfigError, match=r"attention heads \(8\) and KV heads \(4\)"):
        check_tensor_parallel(cfg(model_8_4, 8))
    res = subprocess.run(
        [sys.executable, "-m", "spyre_runtime.cli", "serve", str(model_9_3), "--tensor-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager"},
    )
    assert res.returncode == 2
    (line,) = res.stderr.strip().splitlines()
    assert "--tensor-parallel-size=2 must divide" in line and "(9)" in line and "(3)" in line


def ranks_of(proc: psutil.Process) -> list[psutil.Process]:
    """Worker ranks are spawned processes (multiprocessing's resource tracker is not one)."""
    ranks = []
    for p in proc.children(recursive=True):
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                ranks.append(p)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue  # an exited helper
    return ranks


def tp_server(model, tmp_path, **env) -> ServerProcess:
    return ServerProcess(
        model,
        {"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", **env},
        tmp_path / "server.log",
        extra_args=("--tensor-parallel-size", "2"),
    )


def test_dead_worker_stops_the_server_promptly_and_leaves_nothing(model_8_4, tmp_path):
    logs = tmp_path / "ranks"
    srv = tp_server(model_8_4, tmp_path, SENDNN_INFERENCE_WORKER_LOG_REDIRECT_DIR=str(logs))
    try:
        srv.wait_ready()
        server = psutil.Process(srv.proc.pid)
        family = server.children(recursive=True)
        (worker,) = ranks_of(server)
        assert "Worker rank 1 ready" in (logs / "rank-1.log").read_text()
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        code = srv.proc.wait(timeout=30)
        assert code != 0 and time.monotonic() - t0 < 10
        assert "tensor-parallel worker rank 1 exited" in srv.log()
        _, alive = psutil.wait_procs(family, timeout=10)
        assert alive == []
    finally:
        srv.stop()


def test_sigterm_stops_every_rank(model_8_4, tmp_path):
    srv = tp_server(model_8_4, tmp_path)
    try:
        srv.wait_ready()
        family = psutil.Process(srv.proc.pid).children(recursive=True)
        assert family
        import openai

        c = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=60)
        assert c.completions.create(model="tiny", prompt="hello", max_tokens=3).usage.completion_tokens >= 1
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(family, timeout=10)
        assert alive == []
    finally:
        srv.stop()
