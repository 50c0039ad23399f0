"""A Responses API request as the chat request the rest of the server already runs: `instructions` become
a system message, input items become chat messages (a function_call an assistant message's tool call, a
function_call_output a tool message; reasoning items are dropped, as chat templates drop earlier
reasoning), tools and tool_choice their chat spelling, `text.format` a response_format. A 400 raised on
the chat request names the Responses field it came from (`rename`)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from spyre_runtime.entrypoints.completions.protocol import ChatCompletionRequest
from spyre_runtime.entrypoints.responses.protocol import ResponsesRequest
from spyre_runtime.entrypoints.server.errors import APIError, bad_request

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def _text(value: Any, where: str) -> str:
    """Content as text: a string, or a list of text parts."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal":
            continue
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.{j}", f"content parts of type {kind!r} are not supported (only text)")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and key != "arguments"):
        raise bad_request(f"{where}.{key}", "is required (a string)")
    return value


def item_messages(items: list[dict], origin: str) -> tuple[list[dict], list[str]]:
    """Chat messages of input items, and the parameter each message came from."""
    messages: list[dict] = []
    origins: list[str] = []
    for i, item in enumerate(items):
        where = f"{origin}.{i}"
        if not isinstance(item, dict):
            raise bad_request(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{where}.role", f"must be one of {', '.join(ROLES)}")
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and origins[-1] != "history":
                last.setdefault("tool_calls", []).append(call)  # one assistant turn, several calls
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output")
            messages.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output}
            )
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"{where}.type", f"input items of type {kind!r} are not supported")
        origins.append(where)
    return messages, origins


def chat_request(
    body: ResponsesRequest, history: list[dict], model: str
) -> tuple[ChatCompletionRequest, list[dict], list[str]]:
    """The chat request of `body` after `history` (the messages of the previous stored response), the
    conversation's messages (to store) and the parameter each chat message came from."""
    messages = list(history)
    origins = ["previous_response_id"] * len(history)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
        origins.insert(0, "instructions")
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    new, new_origins = item_messages(items, "input")
    messages += new
    origins += new_origins
    if not messages:
        raise bad_request("input", "is empty")
    if "message.output_text.logprobs" in (body.include or ()):
        raise bad_request("include", "logprobs are not returned by /v1/responses; use /v1/chat/completions")
    chat: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "seed": body.seed,
        "top_k": body.top_k,
        "repetition_penalty": body.repetition_penalty,
        "reasoning_effort": _effort(body),
        "response_format": _response_format(body),
    }
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in body.tools
        ]
    choice = body.tool_choice
    chat["tool_choice"] = (
        {"type": "function", "function": {"name": choice.name}}
        if choice is not None and not isinstance(choice, str)
        else choice
    )
    try:
        request = ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        raise bad_request("input", f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    return request, messages, origins


def _effort(body: ResponsesRequest) -> str | None:
    effort = body.reasoning.effort if body.reasoning else None
    return {"none": None, "xhigh": "high"}.get(effort, effort) if effort else None


def _response_format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("text.format.schema", "json_schema needs a schema")
    schema = {"name": fmt.name or "schema", "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


RENAMES = [
    (re.compile(r"^tools\.(\d+)\.function\.(.*)$"), r"tools.\1.\2"),
    (re.compile(r"^(max_completion_tokens|max_tokens)$"), "max_output_tokens"),
    (re.compile(r"^response_format(.*)$"), r"text.format\1"),
    (re.compile(r"^reasoning_effort$"), "reasoning.effort"),
    (re.compile(r"^prompt$"), "input"),
]


def rename(error: APIError, origins: list[str]) -> APIError:
    """`error`, raised on the chat request, naming the Responses field it came from."""
    param = error.param
    if param is None:
        return error
    match = re.match(r"^messages\.(\d+)(\..*)?$", param)
    if match:
        k = int(match.group(1))
        new = origins[k] if k < len(origins) else "input"
        if match.group(2) == ".content" and new.startswith("input."):
            new += ".content"
    else:
        new = param
        for pattern, repl in RENAMES:
            new = pattern.sub(repl, new)
    message = (
        error.message.replace(f"{param}:", f"{new}:", 1) if error.message.startswith(param) else error.message
    )
    return APIError(error.status, message, new, error.code)
