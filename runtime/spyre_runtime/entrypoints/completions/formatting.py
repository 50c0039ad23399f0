"""Engine outputs as OpenAI's completion and chat responses: the whole body (`build_response`), the
server-sent events of a stream (`stream_events`), and their parts (usage, logprobs in the chat and the
legacy layouts, the best_of pick). Plain functions of the data: no server state."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from spyre_runtime.engine.llm_engine import RequestOutput
from spyre_runtime.entrypoints.chat.chat_output import OutputDelta, OutputParser, OutputStream, ParsedOutput
from spyre_runtime.entrypoints.completions.protocol import ChatCompletionRequest, CompletionRequest
from spyre_runtime.entrypoints.completions.submission import Submission
from spyre_runtime.entrypoints.completions.validator import Choice
from spyre_runtime.entrypoints.server.errors import APIError, error_body
from spyre_runtime.sampling.params import TokenLogprob


class TokenText:
    """Token ids as the text clients see (cached: the same tokens recur in every response)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._strs: dict[int, str] = {}

    def token(self, token_id: int, as_id: bool = False) -> str:
        if as_id:  # vLLM's return_tokens_as_token_ids: what clients use when strings are ambiguous
            return f"token_id:{token_id}"
        text = self._strs.get(token_id)
        if text is None:
            text = self._strs[token_id] = self.tokenizer.decode([token_id])
        return text

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


@dataclass(frozen=True)
class Reply:
    """What every body or chunk of one response shares."""

    sub: Submission
    body: CompletionRequest | ChatCompletionRequest
    created: int
    model: str
    chat: bool
    token_text: TokenText
    output: OutputParser = field(default_factory=OutputParser)  # chat: reasoning and tool calls

    @property
    def as_ids(self) -> bool:
        return bool(self.body.return_tokens_as_token_ids)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def clamp(logprob: float) -> float:
    """JSON has no -Infinity: a token the model gives no chance gets the most negative float (vLLM)."""
    return max(logprob, -9999.0)


def chat_logprobs(token_text: TokenText, lps: tuple[TokenLogprob, ...], as_ids: bool) -> list[dict]:
    def entry(token_id: int, logprob: float) -> dict:
        token = token_text.token(token_id, as_ids)
        return {"token": token, "logprob": clamp(logprob), "bytes": list(token.encode())}

    return [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, x) for t, x in lp.top]} for lp in lps
    ]


def completion_logprobs(
    token_text: TokenText, prompt_ids: list[int], out: RequestOutput, num_top: int, echo: bool, as_ids: bool
) -> dict:
    """OpenAI's legacy layout: tokens, token_logprobs, top_logprobs (the top num_top, plus the chosen
    token, as vLLM), text_offset. With echo the prompt's tokens come first (the first has no logprob)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    entries: list[tuple[int, TokenLogprob | None]] = []
    if echo:
        prompt_lps = out.prompt_logprobs or (None,) * len(prompt_ids)
        entries.extend(zip(prompt_ids, prompt_lps, strict=True))
    entries.extend((lp.token_id, lp) for lp in out.logprobs)
    for token_id, lp in entries:
        token = token_text.token(token_id, as_ids)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(clamp(lp.logprob))
        top = {token_text.token(t, as_ids): clamp(x) for t, x in lp.top[:num_top]}
        top.setdefault(token, clamp(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def pick_best(reply: Reply, outs: list[RequestOutput]) -> list[tuple[Choice, RequestOutput]]:
    """With best_of > n: the n sequences of highest cumulative logprob per prompt, in that order."""
    sub, body = reply.sub, reply.body
    pairs = list(zip(sub.choices, outs, strict=True))
    n = body.n or 1
    best_of = getattr(body, "best_of", None) or n
    if best_of <= n:
        return pairs
    picked = []
    for prompt_index in range(len(sub.prompts)):
        mine = [p for p in pairs if p[0].prompt_index == prompt_index]
        mine.sort(key=lambda p: p[1].cumulative_logprob, reverse=True)
        picked.extend(mine[:n])
    return picked


def finish_reason(reason: str | None, tools_called: bool) -> str | None:
    """A choice that ends in tool calls finishes with "tool_calls" (unless it ran out of tokens)."""
    return "tool_calls" if tools_called and reason == "stop" else reason


def chat_message(output: OutputParser, parsed: ParsedOutput) -> dict:
    message = {
        "role": "assistant",
        "content": parsed.content,
        "tool_calls": [call.as_dict() for call in parsed.calls],
    }
    if output.has_reasoning:
        message["reasoning_content"] = parsed.reasoning
    return message


def _choice_entry(reply: Reply, index: int, choice: Choice, out: RequestOutput) -> dict:
    body = reply.body
    reason = out.finish_reason
    if reply.chat:
        parsed = reply.output.final(out.text)
        reason = finish_reason(reason, bool(parsed.calls))
        entry = {"index": index, "message": chat_message(reply.output, parsed), "logprobs": None}
        if body.logprobs:
            entry["logprobs"] = {"content": chat_logprobs(reply.token_text, out.logprobs, reply.as_ids)}
    else:
        prompt_ids = reply.sub.prompts[choice.prompt_index]
        text = out.text
        lps = None
        if body.echo:
            text = reply.token_text.decode(prompt_ids) + text
        if body.logprobs is not None:
            echoed = prompt_ids if body.echo else []
            lps = completion_logprobs(
                reply.token_text, echoed, out, body.logprobs, bool(body.echo), reply.as_ids
            )
        entry = {"index": index, "text": text, "logprobs": lps}
    entry["finish_reason"] = reason
    entry["stop_reason"] = out.stop_reason
    return entry


def build_response(reply: Reply, finals: dict[str, RequestOutput]) -> dict:
    """The body of a non-streamed response, from every sequence's final output."""
    sub = reply.sub
    outs = [finals[eid] for eid in sub.engine_ids]
    choices = [
        _choice_entry(reply, index, choice, out) for index, (choice, out) in enumerate(pick_best(reply, outs))
    ]
    prompt_tokens = sum(len(p) for p in sub.prompts)
    completion_tokens = sum(len(o.token_ids) for o in outs)
    return {
        "id": sub.rid,
        "object": "chat.completion" if reply.chat else "text_completion",
        "created": reply.created,
        "model": reply.model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
        "system_fingerprint": None,
    }


# ---- streams -------------------------------------------------------------------------------------


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def chunk(reply: Reply, choice: dict | None, include_usage: bool, usage_: dict | None = None) -> str:
    payload = {
        "id": reply.sub.rid,
        "object": "chat.completion.chunk" if reply.chat else "text_completion",
        "created": reply.created,
        "model": reply.model,
        "choices": [{"stop_reason": None, **choice}] if choice else [],
    }
    if include_usage:
        payload["usage"] = usage_
    return event(payload)


def chat_deltas(delta: OutputDelta) -> list[dict]:
    """A chat stream's deltas for what one output brought: content and reasoning first, then each call's
    part in a delta of its own (its id and name, then argument fragments), as OpenAI streams them."""
    first: dict = {}
    if delta.reasoning:
        first["reasoning_content"] = delta.reasoning
    if delta.content:
        first["content"] = delta.content
    calls = []
    for c in delta.calls:
        if c.id is not None:
            function = {"name": c.name, "arguments": c.arguments}
            calls.append({"index": c.index, "id": c.id, "type": "function", "function": function})
        else:
            calls.append({"index": c.index, "function": {"arguments": c.arguments}})
    deltas = [first] if first or not calls else []
    return deltas + [{"tool_calls": [call]} for call in calls]


def delta_choices(reply: Reply, out: RequestOutput, stream: OutputStream | None = None) -> list[dict]:
    """One output's choices in chunks (a chat output's tool calls may take several); none when it brings
    nothing (no text, no logprobs, not finished)."""
    if not (out.delta_text or out.delta_logprobs or out.finished):
        return []
    body = reply.body
    index = reply.sub.choice_of[out.request_id].index
    reason = out.finish_reason if out.finished else None
    if reply.chat:
        stream = stream or reply.output.stream()
        deltas = chat_deltas(stream.feed(out.text, out.finished))
        lps = (
            {"content": chat_logprobs(reply.token_text, out.delta_logprobs, reply.as_ids)}
            if body.logprobs
            else None
        )
        if deltas == [{}] and not (lps or out.finished):
            return []
        reason = finish_reason(reason, stream.tools_called)
        choices = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        choices[0]["logprobs"] = lps
        choices[-1]["finish_reason"] = reason
    else:
        lps = None
        if body.logprobs is not None:
            delta_out = dataclasses.replace(out, logprobs=out.delta_logprobs)
            lps = completion_logprobs(reply.token_text, [], delta_out, body.logprobs, False, reply.as_ids)
        choices = [{"index": index, "text": out.delta_text, "logprobs": lps, "finish_reason": reason}]
    if out.finished:
        choices[-1]["stop_reason"] = out.stop_reason
    return choices


async def stream_events(reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """The server-sent events of a streamed response, until [DONE] (an error ends the stream with an error
    event). Closes the submission at the end, which aborts what still runs when the client went away."""
    sub = reply.sub
    completion_tokens = 0
    streams = {c.index: reply.output.stream() for c in sub.choices} if reply.chat else {}
    try:
        if reply.chat:
            for choice in sub.choices:
                delta = {"role": "assistant", "content": ""}
                first = {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}
                yield chunk(reply, first, include_usage)
        while sub.pending:
            try:
                out = await sub.next()
            except APIError as e:
                yield event(error_body(e.message, "server_error", code=e.code))
                break
            if out.finish_reason == "error":
                yield event(
                    error_body(f"the request failed: {out.error}", "server_error", code="request_failed")
                )
                break
            if out.finished:
                completion_tokens += len(out.token_ids)
            stream = streams.get(sub.choice_of[out.request_id].index)
            for choice in delta_choices(reply, out, stream):
                yield chunk(reply, choice, include_usage)
        else:
            if include_usage:
                prompt_tokens = sum(len(p) for p in sub.prompts)
                yield chunk(reply, None, include_usage, usage(prompt_tokens, completion_tokens))
        yield "data: [DONE]\n\n"
    finally:
        sub.close()
