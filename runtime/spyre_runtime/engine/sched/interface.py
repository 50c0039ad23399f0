"""What a scheduler is, for the engine loops: the one door between a loop and a batching policy. No tensors.

Every scheduler (static.py, continuous.py and pooling.py's) runs the same cycle, driven by its engine loop:

    add(work)                          queue a request (or a pooling input); ValueError when it can never run
    step = schedule()                  what the next engine step runs (None: nothing to run)
    ... the executor runs the step; the engine appends its tokens (or delivers its vectors) ...
    finished = update(step)            what finished and left the scheduler

A generating scheduler (`GenerateScheduler`, static and continuous batching) also admits by limits the
server checks before it queues (`can_admit`, `max_tokens_for`, `describe_limits`), aborts requests, and
reports what the metrics read. Shared admission helpers sit beside this file (admission.py); the policy
is chosen from the configuration in one place (factory.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Generic, TypeVar

from spyre_runtime.request import Request

Work = TypeVar("Work")  # what is queued: a Request, or a pooling input
Step = TypeVar("Step")  # what one engine step runs


class Scheduler(ABC, Generic[Work, Step]):
    """The cycle every engine loop drives: add, schedule, update."""

    @abstractmethod
    def add(self, work: Work) -> None:
        """Queues `work`; raises ValueError (nothing queued) when it can never run."""

    @abstractmethod
    def schedule(self) -> Step | None:
        """The next step, or None when there is nothing to run."""

    @abstractmethod
    def update(self, step: Step) -> Sequence[Work]:
        """Called after the step ran and its results were handed on; returns what finished and left."""

    @abstractmethod
    def has_work(self) -> bool:
        """Something is queued or running."""

    @property
    @abstractmethod
    def num_waiting(self) -> int:
        """Queued, not yet running."""

    @property
    @abstractmethod
    def num_running(self) -> int:
        """Running (holding a row, a slot or blocks), not yet finished."""


class GenerateScheduler(Scheduler[Request, Step]):
    """A scheduler of generate requests (static or continuous batching), as LLMEngine drives it."""

    # vLLM's prefix-cache counters: prompt tokens looked up and found (0 without a prefix cache)
    num_prefix_queries: int
    num_prefix_hits: int

    @abstractmethod
    def can_admit(self, num_prompt_tokens: int, max_tokens: int) -> bool:
        """A request of this size can ever run."""

    @abstractmethod
    def max_tokens_for(self, num_prompt_tokens: int) -> int:
        """The largest max_tokens a prompt of this length can ask for (0: the prompt cannot run)."""

    @abstractmethod
    def describe_limits(self) -> str:
        """What a request that cannot run exceeds, for its error message."""

    @abstractmethod
    def abort(self, request_id: str) -> Request | None:
        """Finishes the request with "abort" wherever it is (None: unknown or already gone)."""

    @property
    @abstractmethod
    def kv_cache_usage(self) -> float:
        """The part of the KV cache held by running requests, 0..1."""

    @abstractmethod
    def take_kv_events(self) -> list:
        """The KV cache events (blocks stored and removed) since the last call."""
