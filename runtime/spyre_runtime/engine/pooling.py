"""The pooling engine: the thread that runs the pooling scheduler's steps (sched/pooling.py batches the
inputs of many requests into the smallest warmed shape that fits) on the pooling model.

    PoolingEngine  thread: schedule -> PoolingModel.run -> deliver each item's vector -> update
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from spyre_runtime.engine.sched.pooling import PoolingScheduler, PoolingStep, PoolItem
from spyre_runtime.executor.families.pooling import PoolingModel, shape_str

log = logging.getLogger(__name__)


class PoolingEngine:
    """The engine thread: waits for inputs, runs one step at a time, delivers outputs. A failed step fails
    its inputs and the engine goes on; `on_step(step, seconds)` observes each step."""

    def __init__(self, model: PoolingModel, scheduler: PoolingScheduler) -> None:
        self.model = model
        self.scheduler = scheduler
        self.on_step: Callable[[PoolingStep, float], None] = lambda step, seconds: None
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="pooling-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, items: list[PoolItem]) -> None:
        with self._cond:
            for item in items:
                self.scheduler.add(item)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            with self._cond:
                step = self.scheduler.schedule()
                while step is None and not self._stopped:
                    self._cond.wait()
                    step = self.scheduler.schedule()
                if self._stopped:
                    return
            t0 = time.monotonic()
            try:
                out = self.model.run(step.shape, [(i.token_ids, i.type_ids) for i in step.items])
            except Exception as e:
                log.exception("pooling step at %s failed", shape_str(step.shape))
                for item in step.items:
                    item.deliver(e)
                self.scheduler.update(step)
                continue
            for item, row in zip(step.items, out, strict=True):
                item.deliver(row)
            self.scheduler.update(step)
            self.on_step(step, time.monotonic() - t0)
