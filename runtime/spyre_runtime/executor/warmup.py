"""Warm-up progress a person watching a pod start can follow: one line per compiled graph,
`[Warmup][Decode][3/12] batch_size:4 kv_len:256 took 9.81 s, ETA 88 s`, and the same count for `/health`
(503 with {"warming": {"done": i, "total": N}}) and a Prometheus gauge, so the operator can show it."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("spyre_runtime.executor.warmup")


class WarmupProgress:
    def __init__(self, total: int = 0, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.total = total
        self.done = 0
        self.started = clock()

    def start(self, total: int) -> None:
        with self._lock:
            self.total, self.done, self.started = total, 0, self._clock()

    def step(self, kind: str, shape: str, seconds: float) -> str:
        """Records one graph compiled and warmed; logs and returns its line."""
        with self._lock:
            self.done += 1
            done, total = self.done, max(self.total, self.done)
            elapsed = self._clock() - self.started
        eta = elapsed / done * (total - done)
        line = f"[Warmup][{kind}][{done}/{total}] {shape} took {seconds:.2f} s, ETA {eta:.0f} s"
        log.info(line)
        return line

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"done": self.done, "total": self.total}
