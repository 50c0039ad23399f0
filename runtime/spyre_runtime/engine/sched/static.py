"""The static batching policy: which requests run in the next engine step; never touches tensors.

One engine step is: step = scheduler.schedule(); executor runs it; engine appends tokens and marks finished
requests; scheduler.update(step). The static scheduler below is the seeds' behaviour:

    waiting: [r0 r1 r2 r3 ...]  --schedule()-->  prefill(shape, rows)   one batch at a time
    running: rows of one shape  --schedule()-->  decode(shape, rows, t)  until every row is finished
    no new prefill starts while a batch is running.
"""

from __future__ import annotations

from collections import deque

from spyre_runtime.config import Shape
from spyre_runtime.engine.sched.admission import abort_waiting, check_admissible
from spyre_runtime.engine.sched.interface import GenerateScheduler
from spyre_runtime.request import Request, Status
from spyre_runtime.steps import StaticStep


def smallest_fitting_shape(
    shapes: tuple[Shape, ...], num_prompt_tokens: int, max_tokens: int
) -> Shape | None:
    fitting = [s for s in shapes if s.fits(num_prompt_tokens, max_tokens)]
    return min(fitting, key=_sequence_cost) if fitting else None


def _sequence_cost(shape: Shape) -> tuple[int, int, int]:
    return (shape.max_len, shape.prompt_len, shape.batch_size)


class StaticScheduler(GenerateScheduler[StaticStep]):
    def __init__(self, shapes: tuple[Shape, ...]) -> None:
        if not shapes:
            raise ValueError("at least one warmup shape is needed")
        self.shapes = tuple(sorted(shapes))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._running_shape: Shape | None = None
        self._decode_index = 0
        self.num_prefix_queries = self.num_prefix_hits = 0  # no prefix cache (vLLM's counters stay at 0)

    # ---- queue -----------------------------------------------------------------------------------

    def can_admit(self, num_prompt_tokens: int, max_tokens: int) -> bool:
        return smallest_fitting_shape(self.shapes, num_prompt_tokens, max_tokens) is not None

    def max_tokens_for(self, num_prompt_tokens: int) -> int:
        """The largest max_tokens a prompt of this length can ask for (0: no shape takes the prompt)."""
        return max((s.new_tokens for s in self.shapes if s.prompt_len >= num_prompt_tokens), default=0)

    def describe_limits(self) -> str:
        return "fits no compiled shape; compiled shapes: " + ", ".join(str(s) for s in self.shapes)

    def add(self, request: Request) -> None:
        check_admissible(self, request)
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Removes a waiting request, or finishes a running one (its row stays until the batch ends)."""
        req = abort_waiting(self.waiting, request_id)
        if req is not None:
            return req
        for req in self.running:
            if req.request_id == request_id and not req.is_finished:
                req.finish("abort")
                return req
        return None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return sum(not r.is_finished for r in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kv_cache_usage(self) -> float:
        """Rows of the running batch still generating over the rows of its shape (0 with no batch)."""
        shape = self._running_shape
        return self.num_running / shape.batch_size if shape is not None else 0.0

    def take_kv_events(self) -> list:
        return []  # no prefix cache

    # ---- steps -----------------------------------------------------------------------------------

    def schedule(self) -> StaticStep | None:
        if self.running:
            return StaticStep(False, self._running_shape, tuple(self.running), self._decode_index)
        if not self.waiting:
            return None
        shape, group = self._form_batch()
        for req in group:
            self.waiting.remove(req)
            req.status = Status.RUNNING
        self.running = group
        self._running_shape = shape
        self._decode_index = 0
        return StaticStep(True, shape, tuple(group))

    def _form_batch(self) -> tuple[Shape, list[Request]]:
        """The oldest request always goes. Among the shapes it fits, the one that takes the most waiting
        requests (in arrival order, up to its batch size) wins, the cheaper one on a tie; the batch then runs
        in the smallest shape that holds every member. Requests left out keep their place in the queue."""
        head = self.waiting[0]
        best: tuple[tuple, list[Request]] | None = None
        for shape in self.shapes:
            if not shape.fits(head.num_prompt_tokens, head.sampling.max_tokens):
                continue
            group = [r for r in self.waiting if shape.fits(r.num_prompt_tokens, r.sampling.max_tokens)]
            group = group[: shape.batch_size]
            key = (-len(group), _sequence_cost(shape))
            if best is None or key < best[0]:
                best = (key, group)
        group = best[1]
        holders = [
            s
            for s in self.shapes
            if s.batch_size >= len(group)
            and all(s.fits(r.num_prompt_tokens, r.sampling.max_tokens) for r in group)
        ]
        return min(holders, key=_sequence_cost), group

    def update(self, step: StaticStep) -> list[Request]:
        """Called after the engine appended this step's tokens. Returns the requests that finished and
        left the scheduler (the whole batch leaves at once, when its last row finishes)."""
        if all(r.is_finished for r in self.running):
            done, self.running, self._running_shape = self.running, [], None
            return done
        self._decode_index = 0 if step.is_prefill else step.decode_index + 1
        return []
