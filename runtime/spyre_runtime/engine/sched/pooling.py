"""The pooling scheduler: batches the inputs of many requests into the smallest warmed shape that fits.
Pure (no model): the pooling engine's thread (engine/pooling.py) drives it through the scheduler interface.

    PoolingScheduler.schedule() -> PoolingStep(shape, items)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spyre_runtime.config import Shape
from spyre_runtime.engine.sched.interface import Scheduler


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


class PoolingScheduler(Scheduler[PoolItem, PoolingStep]):
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

    @property
    def num_running(self) -> int:
        return 0  # a step's inputs are delivered within the step

    def has_work(self) -> bool:
        return bool(self.waiting)

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

    def update(self, step: PoolingStep) -> tuple[PoolItem, ...]:
        """Every input of a step finishes with it (its vector, or its error, was delivered)."""
        return step.items
