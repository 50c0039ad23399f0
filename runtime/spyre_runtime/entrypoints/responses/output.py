"""A generated choice as a Responses API `Response`: output items (a reasoning item, a message with its
output_text, one function_call item per tool call), usage and the request's settings echoed; and, for a
stream, the typed server-sent events the `openai` client parses, in OpenAI's order:

    response.created, response.in_progress
    per item: response.output_item.added
              reasoning/message: response.content_part.added, *.delta ..., *.done, response.content_part.done
              function_call: response.function_call_arguments.delta ..., response.function_call_arguments.done
              response.output_item.done
    response.completed (or response.incomplete when max_output_tokens ran out)
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from spyre_runtime.entrypoints.chat.chat_output import OutputDelta, ParsedOutput, ToolCall
from spyre_runtime.entrypoints.responses.protocol import ResponsesRequest


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ResponseMeta:
    """What every event of one response shares."""

    id: str
    created_at: int
    model: str
    body: ResponsesRequest
    store: bool


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict:
    """`cached_tokens`: input tokens served from the prefix cache; `reasoning_tokens`: output tokens the
    reasoning took (the reasoning parser's count)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def response_object(meta: ResponseMeta, status: str, output: list[dict], usage_: dict | None) -> dict:
    body = meta.body
    fmt = (
        body.text.format.model_dump(by_alias=True, exclude_none=True)
        if body.text and body.text.format
        else None
    )
    choice = body.tool_choice
    return {
        "id": meta.id,
        "object": "response",
        "created_at": meta.created_at,
        "status": status,
        "model": meta.model,
        "output": output,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "store": meta.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": fmt or {"type": "text"}},
        "tool_choice": choice.model_dump()
        if choice is not None and not isinstance(choice, str)
        else (choice or "auto"),
        "tools": [t.model_dump() for t in body.tools or ()],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "usage": usage_,
        "user": body.user,
        "metadata": body.metadata or {},
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
    }


def reasoning_item(id_: str, text: str, status: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": id_, "summary": [], "content": content, "status": status}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(id_: str, text: str | None, status: str) -> dict:
    content = [text_part(text)] if text is not None else []
    return {"type": "message", "id": id_, "status": status, "role": "assistant", "content": content}


def call_item(id_: str, call: ToolCall, status: str) -> dict:
    return {
        "type": "function_call",
        "id": id_,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def output_items(parsed: ParsedOutput, finish_reason: str | None) -> list[dict]:
    status = "incomplete" if finish_reason == "length" else "completed"
    items = []
    if parsed.reasoning:
        items.append(reasoning_item(item_id("rs"), parsed.reasoning, status))
    if parsed.content:
        items.append(message_item(item_id("msg"), parsed.content, status))
    items += [call_item(item_id("fc"), call, "completed") for call in parsed.calls]
    return items


def assistant_turn(parsed: ParsedOutput) -> dict:
    """The response as the assistant message a later turn's chat template reads (reasoning dropped)."""
    calls = [c.as_dict() for c in parsed.calls]
    return {"role": "assistant", "content": parsed.content, **({"tool_calls": calls} if calls else {})}


@dataclass
class _Open:
    index: int
    item: dict
    text: str = ""


@dataclass
class EventWriter:
    """The events of one streamed response; `output` holds the items as they are closed."""

    meta: ResponseMeta
    seq: int = 0
    output: list[dict] = field(default_factory=list)
    open: _Open | None = None
    calls: dict[int, _Open] = field(default_factory=dict)
    final: dict | None = None  # the response the last event carried

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def start(self) -> list[str]:
        response = response_object(self.meta, "in_progress", [], None)
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def delta(self, d: OutputDelta) -> list[str]:
        out = []
        if d.reasoning:
            out += self._text("reasoning", d.reasoning)
        if d.content:
            out += self._text("message", d.content)
        for c in d.calls:
            if c.id is not None:
                out += self._close()
                index = len(self.output)  # items are streamed one at a time
                item = call_item(item_id("fc"), ToolCall(c.id, c.name, ""), "in_progress")
                self.calls[c.index] = self.open = _Open(index, item)
                out.append(self.event("response.output_item.added", output_index=index, item=item))
            else:
                call = self.calls[c.index]
                call.text += c.arguments
                fields = {"item_id": call.item["id"], "output_index": call.index, "delta": c.arguments}
                out.append(self.event("response.function_call_arguments.delta", **fields))
        return out

    def _text(self, kind: str, delta: str) -> list[str]:
        out = []
        if self.open is None or self.open.item["type"] != kind:
            out += self._close()
            index = len(self.output)
            if kind == "reasoning":
                item, part = (
                    reasoning_item(item_id("rs"), "", "in_progress"),
                    {"type": "reasoning_text", "text": ""},
                )
                item["content"] = []
            else:
                item, part = message_item(item_id("msg"), None, "in_progress"), text_part("")
            self.open = _Open(index, item)
            out.append(self.event("response.output_item.added", output_index=index, item=item))
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(self.event("response.content_part.added", **where, part=part))
        self.open.text += delta
        where = {"item_id": self.open.item["id"], "output_index": self.open.index, "content_index": 0}
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", **where, delta=delta))
        else:
            out.append(self.event("response.output_text.delta", **where, delta=delta, logprobs=[]))
        return out

    def _close(self, status: str = "completed") -> list[str]:
        opened, self.open = self.open, None
        if opened is None:
            return []
        item, kind = opened.item, opened.item["type"]
        where = {"item_id": item["id"], "output_index": opened.index}
        out = []
        if kind == "function_call":
            item = {**item, "arguments": opened.text, "status": "completed"}
            out.append(
                self.event(
                    "response.function_call_arguments.done", **where, name=item["name"], arguments=opened.text
                )
            )
        elif kind == "reasoning":
            part = {"type": "reasoning_text", "text": opened.text}
            item = reasoning_item(item["id"], opened.text, status)
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=opened.text))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        else:
            item = message_item(item["id"], opened.text, status)
            out.append(
                self.event(
                    "response.output_text.done", **where, content_index=0, text=opened.text, logprobs=[]
                )
            )
            out.append(
                self.event(
                    "response.content_part.done", **where, content_index=0, part=text_part(opened.text)
                )
            )
        self.output.append(item)
        out.append(self.event("response.output_item.done", output_index=opened.index, item=item))
        return out

    def finish(self, finish_reason: str | None, usage_: dict) -> list[str]:
        status = "incomplete" if finish_reason == "length" else "completed"
        out = self._close("incomplete" if status == "incomplete" else "completed")
        self.final = response_object(self.meta, status, self.output, usage_)
        out.append(self.event(f"response.{status}", response=self.final))
        return out
