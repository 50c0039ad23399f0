"""Admission helpers every generate scheduler shares (interface.py): refusing a request that can never run,
in one message naming it and the scheduler's limits, and taking a waiting request out of the queue."""

from __future__ import annotations

from collections import deque

from spyre_runtime.engine.sched.interface import GenerateScheduler
from spyre_runtime.request import Request


def check_admissible(scheduler: GenerateScheduler, request: Request) -> None:
    """Raises ValueError naming the request and the scheduler's limits when it can never run."""
    if not scheduler.can_admit(request.num_prompt_tokens, request.sampling.max_tokens):
        raise ValueError(
            f"request {request.request_id} ({request.num_prompt_tokens} prompt tokens, "
            f"max_tokens={request.sampling.max_tokens}) {scheduler.describe_limits()}"
        )


def abort_waiting(waiting: deque[Request], request_id: str) -> Request | None:
    for req in waiting:
        if req.request_id == request_id:
            waiting.remove(req)
            req.finish("abort")
            return req
    return None
