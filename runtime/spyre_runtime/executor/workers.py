"""Tensor parallelism across the cards of a pod: one process per card, joined with torch.distributed (gloo).

    rank 0 (the server/engine process)            ranks 1..N-1 (worker processes, spawned by rank 0)
    scheduler → executor._run(args) ──broadcast──► worker loop: executor.run_local(args)
                      │ compiled forward with FMS's tensor-parallel all-reduce / all-gather (gloo)
                      ▼
                  logits (gathered on every rank; rank 0 samples)

Rank 0 owns the scheduler and sends every step's input tensors to the others; every rank runs the same
compiled shapes in the same order, so collectives always pair up. Messages are ("run", (args, live rows)),
("env", dict) (e.g. the inductor cache directory before the first compile), ("warm", None) and ("stop", None).
Rank 0 passes the executor class its ranks build (the executor imports this module, not the other way round).
A monitor thread on rank 0 watches the workers: if one dies, it logs which, kills the others and ends the
process with exit code 3 within a second, so nothing waits on a collective forever. Workers end within a
second of rank 0. Collectives time out after SENDNN_INFERENCE_GLOO_TIMEOUT_MINUTES.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from spyre_runtime.config import ConfigError, RuntimeConfig
from spyre_runtime.executor.graph_cache import resolve_vector_isa
from spyre_runtime.executor.loader import configure_threads

log = logging.getLogger(__name__)

WORKER_DIED_EXIT_CODE = 3


def check_tensor_parallel(config: RuntimeConfig) -> None:
    """N must divide the model's attention heads and KV heads (read from config.json)."""
    n = config.tensor_parallel_size
    if n == 1:
        return
    cfg = json.loads((config.model_dir / "config.json").read_text())
    heads = cfg.get("num_attention_heads") or cfg.get("n_head") or cfg.get("nheads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    if not heads or heads % n or kv_heads % n:
        raise ConfigError(
            f"--tensor-parallel-size={n} must divide the model's attention heads ({heads}) and KV heads "
            f"({kv_heads}); {config.model_dir.name} cannot be split {n} ways"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_process_group(config: RuntimeConfig, rank: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo",
        init_method="env://",
        rank=rank,
        world_size=config.tensor_parallel_size,
        timeout=datetime.timedelta(minutes=config.gloo_timeout_minutes),
    )


# builds a rank's executor: (config, rank=rank) -> an object with run_local, score_local and is_warm; it is
# sent to the spawned process, so a module-level class or function (the ModelExecutor class)
ExecutorFactory = Callable[..., object]


class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1, each running an executor built by `make_executor`."""

    def __init__(self, config: RuntimeConfig, make_executor: ExecutorFactory) -> None:
        self.config = config
        port = _free_port()
        ctx = multiprocessing.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=worker_main,
                args=(config, rank, port, make_executor),
                name=f"tp-rank-{rank}",
                daemon=False,
            )
            for rank in range(1, config.tensor_parallel_size)
        ]
        for p in self.procs:
            p.start()
        self._stopping = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()
        _init_process_group(config, 0, port)
        log.info("Tensor parallel: %d ranks joined (gloo, port %d)", config.tensor_parallel_size, port)

    def send(self, op: str, payload=None) -> None:
        dist.broadcast_object_list([(op, payload)], src=0)

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            for rank, p in enumerate(self.procs, 1):
                if p.exitcode is not None and not self._stopping.is_set():
                    log.error(
                        "tensor-parallel worker rank %d exited with code %s; stopping", rank, p.exitcode
                    )
                    self._kill_all()
                    logging.shutdown()
                    os._exit(WORKER_DIED_EXIT_CODE)

    def kill(self) -> None:
        """Ends every worker at once: after a failed step they may wait in a collective forever."""
        self._stopping.set()
        self._kill_all()

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.exitcode is None and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)

    def stop(self, timeout: float = 10) -> None:
        """Tells every worker to leave, waits, then kills what is left."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        with contextlib.suppress(RuntimeError):  # a worker is already gone
            self.send("stop")
        for p in self.procs:
            p.join(timeout)
        self._kill_all()
        if dist.is_initialized():
            dist.destroy_process_group()


def _die_with_parent() -> None:
    """Ends this rank when rank 0 is gone. (Not PR_SET_PDEATHSIG: it fires when the *thread* that spawned
    us ends, and rank 0 spawns workers from its start-up thread.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _redirect_output(config: RuntimeConfig, rank: int) -> None:
    if not config.worker_log_redirect_dir:
        return
    directory = Path(config.worker_log_redirect_dir)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def worker_main(config: RuntimeConfig, rank: int, port: int, make_executor: ExecutorFactory) -> None:
    """Ranks 1..N-1: load the shard, then run whatever rank 0 broadcasts until told to stop."""
    _die_with_parent()
    _redirect_output(config, rank)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when to stop
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"
    )
    configure_threads(config)
    _init_process_group(config, rank, port)
    executor = make_executor(config, rank=rank)  # loads in a load slot, then meets the others at a barrier
    # rank 0 warms under a raised recompile limit; the same shapes arrive here in the same order
    torch._dynamo.config.recompile_limit = 1 << 12
    torch._dynamo.config.accumulated_recompile_limit = 1 << 14
    log.info("Worker rank %d ready", rank)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        op, payload = box[0]
        if op == "run":
            args, live_rows = payload
            _run_or_die(functools.partial(executor.run_local, live_rows=live_rows), args)
        elif op == "score":
            _run_or_die(executor.score_local, (payload,))
        elif op == "env":
            if "TORCHINDUCTOR_CACHE_DIR" in payload:
                resolve_vector_isa()  # before the private cache directory, as rank 0 does (graph_cache.py)
            os.environ.update(payload)
        elif op == "warm":
            executor.is_warm = True
        elif op == "stop":
            break
    dist.destroy_process_group()
    log.info("Worker rank %d stopped", rank)


def _run_or_die(fn, args) -> None:
    """A step that fails on a worker rank leaves the ranks out of step: this rank exits non-zero at once
    (rank 0's monitor then ends the server with WORKER_DIED_EXIT_CODE), as a failed step on rank 0 does."""
    try:
        fn(*args)
    except BaseException:
        log.exception("step failed on this rank; exiting")
        logging.shutdown()
        os._exit(1)
