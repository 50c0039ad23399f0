"""One work queue, as controller-runtime has it: events only enqueue a key; a key is processed by one worker
at a time; a key added while queued is coalesced, and one added while it is being processed runs once more
afterwards; a failed pass is retried with exponential back-off; a pass may ask to run again later."""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Result:
    """What one pass asks of the queue: `failed` retries with back-off, `after` runs again later."""

    failed: bool = False
    after: float | None = None


class WorkQueue:
    def __init__(
        self,
        process: Callable[[Hashable], Result | None],
        workers: int = 4,
        base_delay: float = 1.0,
        max_delay: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.process = process
        self.num_workers = workers
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.clock = clock
        self._cv = threading.Condition()
        self._ready: deque[Hashable] = deque()
        self._queued: set[Hashable] = set()
        self._processing: set[Hashable] = set()
        self._dirty: set[Hashable] = set()
        self._delayed: list[tuple[float, int, Hashable]] = []
        self._failures: dict[Hashable, int] = {}
        self._seq = 0
        self._stop = False
        self._threads: list[threading.Thread] = []

    # ---- producers ---------------------------------------------------------------------------------

    def add(self, key: Hashable, delay: float = 0.0) -> None:
        with self._cv:
            if delay > 0:
                self._seq += 1
                heapq.heappush(self._delayed, (self.clock() + delay, self._seq, key))
            elif key in self._processing:
                self._dirty.add(key)
            elif key not in self._queued:
                self._queued.add(key)
                self._ready.append(key)
            self._cv.notify()

    def forget(self, key: Hashable) -> None:
        with self._cv:
            self._failures.pop(key, None)

    def failures(self, key: Hashable) -> int:
        with self._cv:
            return self._failures.get(key, 0)

    def depth(self) -> int:
        with self._cv:
            return len(self._ready) + len(self._delayed)

    # ---- workers -----------------------------------------------------------------------------------

    def start(self) -> None:
        for i in range(self.num_workers):
            t = threading.Thread(target=self._work, name=f"reconcile-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)

    def _promote_due(self) -> float | None:
        """Moves due delayed keys to the ready queue; returns seconds until the next one (None: none)."""
        now = self.clock()
        while self._delayed and self._delayed[0][0] <= now:
            _, _, key = heapq.heappop(self._delayed)
            if key in self._processing:
                self._dirty.add(key)
            elif key not in self._queued:
                self._queued.add(key)
                self._ready.append(key)
        return self._delayed[0][0] - now if self._delayed else None

    def _next(self) -> Hashable | None:
        with self._cv:
            while not self._stop:
                wait = self._promote_due()
                if self._ready:
                    key = self._ready.popleft()
                    self._queued.discard(key)
                    self._processing.add(key)
                    return key
                self._cv.wait(timeout=wait if wait is not None else 1.0)
            return None

    def _work(self) -> None:
        while (key := self._next()) is not None:
            try:
                result = self.process(key) or Result()
            except Exception:  # a bug in one pass must not end the worker: retry with back-off
                log.exception("reconcile of %s raised", key)
                result = Result(failed=True)
            with self._cv:
                self._processing.discard(key)
                if result.failed:
                    n = self._failures.get(key, 0)
                    self._failures[key] = n + 1
                    delay = min(self.max_delay, self.base_delay * (2**n))
                    self._seq += 1
                    heapq.heappush(self._delayed, (self.clock() + delay, self._seq, key))
                else:
                    self._failures.pop(key, None)
                    if result.after is not None:
                        self._seq += 1
                        heapq.heappush(self._delayed, (self.clock() + result.after, self._seq, key))
                if key in self._dirty:
                    self._dirty.discard(key)
                    if key not in self._queued:
                        self._queued.add(key)
                        self._ready.append(key)
                self._cv.notify_all()
