"""OpenAI's Responses API on a decoder model: `POST /v1/responses` (text or message input, instructions,
function tools through the same tool parsers and grammars as chat, reasoning items, typed stream events),
`GET` and `DELETE /v1/responses/{id}`.

State: none unless asked. A request with `store: true` (OpenAI's default is true; ours is false, so
nothing is kept by default) is kept in memory, in this process only, for the last MAX_STORED responses:
the response body (for GET) and the conversation's messages without `instructions` (for a later request's
`previous_response_id`, which continues it; instructions are not carried over, as in OpenAI's API). A
restart, or MAX_STORED newer stored responses, forgets it: previous_response_id then gets a 404."""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from spyre_runtime.engine.outputs import RequestOutput, decode_output
from spyre_runtime.entrypoints.chat.chat_output import OutputParser
from spyre_runtime.entrypoints.chat.prompts import render_chat, tokenize
from spyre_runtime.entrypoints.chat.tools import ChatSettings, plan_tools
from spyre_runtime.entrypoints.completions.state import generate_state
from spyre_runtime.entrypoints.completions.submission import Submission, collect
from spyre_runtime.entrypoints.responses.input import chat_request, rename
from spyre_runtime.entrypoints.responses.output import (
    EventWriter,
    ResponseMeta,
    assistant_turn,
    item_id,
    output_items,
    response_object,
    usage,
)
from spyre_runtime.entrypoints.responses.protocol import ResponsesRequest
from spyre_runtime.entrypoints.server.errors import APIError

MAX_STORED = 256


class ResponseStore:
    """Responses created with store: true, the newest MAX_STORED, in this process's memory."""

    def __init__(self, capacity: int = MAX_STORED) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, rid: str, body: dict, messages: list[dict]) -> None:
        self._items[rid] = (body, messages)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str, param: str | None = None) -> tuple[dict, list[dict]]:
        if rid not in self._items:
            raise APIError(
                404, f"response {rid!r} is not stored here (store: true keeps it)", param, "not_found"
            )
        return self._items[rid]

    def delete(self, rid: str) -> None:
        self.get(rid)
        del self._items[rid]


async def create_response(body: ResponsesRequest, request: Request):
    state = generate_state(request)
    v = state.ready_validator()
    v.model(body.model)
    store: ResponseStore = request.app.state.responses
    settings: ChatSettings = request.app.state.chat
    history = (
        store.get(body.previous_response_id, "previous_response_id")[1] if body.previous_response_id else []
    )
    model = state.config.served_model_name
    chat, messages, origins = chat_request(body, history, model)
    reasoning = settings.new_reasoning_parser()
    try:
        plan = plan_tools(chat, settings)
        tokenizer = state.client.tokenizer
        ids = tokenize(tokenizer, render_chat(tokenizer, chat), False, "messages")
        ends = reasoning.end_markers if reasoning else ()
        params = v.sampling(chat, len(ids), chat=True, tools=plan, reasoning_end=ends)
        choices = v.choices(chat, params, 0)
    except APIError as e:
        raise rename(e, origins) from None
    meta = ResponseMeta(item_id("resp"), int(time.time()), model, body, body.store is True)
    sub = state.submit(meta.id, choices, [ids], headers=request.headers)
    output = OutputParser(plan, reasoning)
    kept = [m for m, o in zip(messages, origins, strict=True) if o != "instructions"]
    usage_of = functools.partial(_usage, ids, reasoning, tokenizer, params.skip_special_tokens)
    if body.stream:
        events = stream_response(meta, sub, output, store, kept, usage_of)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        finals = await collect(request, sub)
    finally:
        sub.close()
    if finals is None:
        return Response(status_code=499)
    out = finals[sub.engine_ids[0]]
    if out.finish_reason == "error":
        raise APIError(500, f"the request failed: {out.error}", code="request_failed")
    parsed = output.final(out.text)
    status = "incomplete" if out.finish_reason == "length" else "completed"
    items = output_items(parsed, out.finish_reason)
    result = response_object(meta, status, items, usage_of(out))
    if meta.store:
        store.put(meta.id, result, [*kept, assistant_turn(parsed)])
    return result


def _usage(prompt: list[int], reasoning, tokenizer, skip_special_tokens: bool, out: RequestOutput) -> dict:
    """The response's usage: the prefix cache's hits among the input tokens, the reasoning parser's count
    of the output tokens the reasoning took."""
    tokens = list(out.token_ids)
    counted = 0
    if reasoning is not None:
        counted = reasoning.count_tokens(
            tokens, lambda ids: decode_output(tokenizer, prompt, ids, skip_special_tokens)
        )
    return usage(len(prompt), len(tokens), out.num_cached_tokens, counted)


async def stream_response(
    meta: ResponseMeta,
    sub: Submission,
    output: OutputParser,
    store: ResponseStore,
    kept: list[dict],
    usage_of,
) -> AsyncIterator[str]:
    writer = EventWriter(meta)
    stream = output.stream()
    try:
        for event in writer.start():
            yield event
        while sub.pending:
            try:
                out = await sub.next()
            except APIError as e:
                yield writer.event("error", code=e.code, message=e.message, param=None)
                return
            if out.finish_reason == "error":
                yield writer.event(
                    "error", code="request_failed", message=f"the request failed: {out.error}", param=None
                )
                return
            for event in writer.delta(stream.feed(out.text, out.finished)):
                yield event
            if out.finished:
                for event in writer.finish(out.finish_reason, usage_of(out)):
                    yield event
                if meta.store:
                    store.put(meta.id, writer.final, [*kept, assistant_turn(stream.sent())])
    finally:
        sub.close()


def stored_response(request: Request, rid: str) -> dict:
    return request.app.state.responses.get(rid)[0]


def delete_stored(request: Request, rid: str) -> dict:
    request.app.state.responses.delete(rid)
    return {"id": rid, "object": "response", "deleted": True}
