"""One HTTP request's sequences in the decoder engine: submitted together, their outputs read from one
queue, and aborted together when the client goes away."""

from __future__ import annotations

import asyncio

from fastapi import Request

from spyre_runtime.engine.client import EngineClient, EngineDied
from spyre_runtime.engine.outputs import RequestOutput
from spyre_runtime.entrypoints.completions.validator import Choice
from spyre_runtime.entrypoints.server.errors import APIError
from spyre_runtime.request import ImageInput


class Submission:
    """The engine requests of one HTTP request (prompts x choices), sharing one queue of outputs (the
    engine client puts the engine thread's outputs there, on the event loop)."""

    def __init__(
        self,
        client: EngineClient,
        rid: str,
        choices: list[Choice],
        prompts: list[list[int]],
        images: ImageInput | None = None,
    ) -> None:
        self.client = client
        self.rid = rid
        self.choices = choices
        self.prompts = prompts
        self.images = images  # an image-text model's images, of every choice of the one prompt
        self.queue: asyncio.Queue = asyncio.Queue()
        self.engine_ids = [f"{rid}-{c.index}" for c in choices]
        self.choice_of = dict(zip(self.engine_ids, choices, strict=True))
        self.pending = set(self.engine_ids)
        self.trace = None  # (the server's RequestTracer, the caller's trace context) when tracing is on

    def submit(self) -> None:
        for eid, choice in zip(self.engine_ids, self.choices, strict=True):
            self.client.submit(self.queue, self.prompts[choice.prompt_index], choice.params, eid, self.images)

    def close(self) -> None:
        """Aborts what is still running (the client went away) and forgets the queue."""
        for eid in self.engine_ids:
            self.client.forget(eid)
        for eid in self.pending:
            self.client.abort(eid)
        self.pending.clear()

    async def next(self) -> RequestOutput:
        item = await self.queue.get()
        if isinstance(item, EngineDied):
            raise APIError(500, item.message, code="engine_dead")
        if item.finished:
            self.pending.discard(item.request_id)
            if self.trace is not None:
                tracer, context = self.trace
                tracer.record(context, item, self.choice_of[item.request_id].params, len(self.choices))
        return item


async def collect(request: Request, sub: Submission) -> dict[str, RequestOutput] | None:
    """Waits for every sequence's final output, or returns None when the client hangs up first."""
    finals: dict[str, RequestOutput] = {}
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        while sub.pending:
            get = asyncio.ensure_future(sub.next())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                return None
            out = get.result()
            if out.finished:
                finals[out.request_id] = out
        return finals
    finally:
        gone.cancel()


async def until_disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body was read already, so the next message is the end)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
