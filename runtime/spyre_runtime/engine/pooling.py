"""The pooling engine: a scheduler that batches the inputs of many requests into the smallest warmed shape
that fits, and the thread that runs them.

    PoolingScheduler.schedule() -> PoolingStep(shape, items)      (pure, tested without a model)
    PoolingEngine  thread: schedule -> PoolingModel.run -> deliver each item's vector
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spyre_runtime.config import Shape
from spyre_runtime.executor.pooling_model import PoolingModel, shape_str

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PoolItem:
    """One input (a text, or a pair for cross-encoders) of a request; `deliver` receives its output
    (a tensor) or an exception, on the engine thread."""

    token_ids: list[int]
    type_ids: list[int] | None
    deliver: Callable[[torch.Tensor | BaseException], None]
    is_cancelled: bool = False
    arrival: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class PoolingStep:
    shape: Shape
    items: tuple[PoolItem, ...]

    @property
    def occupancy(self) -> float:
        return len(self.items) / self.shape.batch_size


class PoolingScheduler:
    """First come, first served: the oldest input always runs in the next step; later inputs join it
    while some shape holds them all; the step runs at the smallest such shape (the shortest prompt length,
    then the narrowest batch): padding a batch costs less than padding every row to a longer length."""

    def __init__(self, shapes: tuple[Shape, ...]) -> None:
        self.shapes = tuple(sorted(shapes, key=lambda s: (s.prompt_len, s.batch_size)))
        self.max_len = max(s.prompt_len for s in shapes)
        self.waiting: deque[PoolItem] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def can_fit(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_len

    def add(self, item: PoolItem) -> None:
        if not self.can_fit(len(item.token_ids)):
            raise ValueError(f"an input of {len(item.token_ids)} tokens fits no shape")
        self.waiting.append(item)

    def schedule(self) -> PoolingStep | None:
        while self.waiting and self.waiting[0].is_cancelled:
            self.waiting.popleft()
        if not self.waiting:
            return None
        chosen: list[PoolItem] = []
        longest = 0
        skipped: list[PoolItem] = []
        while self.waiting:
            item = self.waiting.popleft()
            if item.is_cancelled:
                continue
            length = max(longest, len(item.token_ids))
            if self._smallest(length, len(chosen) + 1) is None:
                skipped.append(item)
                if len(item.token_ids) <= longest:
                    break  # the batch is full for every shape that holds its longest input
                continue
            chosen.append(item)
            longest = length
        self.waiting.extendleft(reversed(skipped))
        return PoolingStep(self._smallest(longest, len(chosen)), tuple(chosen))

    def _smallest(self, length: int, count: int) -> Shape | None:
        return next((s for s in self.shapes if s.prompt_len >= length and s.batch_size >= count), None)


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
                continue
            for item, row in zip(step.items, out, strict=True):
                item.deliver(row)
            self.on_step(step, time.monotonic() - t0)
