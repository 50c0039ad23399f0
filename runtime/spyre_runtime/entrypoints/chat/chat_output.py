"""A choice's generated text as an assistant message: the reasoning split out (--reasoning-parser), then
tool calls read out of the rest (tools.ToolPlan), for a whole response (`OutputParser.final`) and for a
stream (`OutputStream.feed`: what is new since the last feed, as a stream may send it). Chat completions
and the Responses API format the same values.

A stream re-reads the whole text at each feed and sends what grew: reasoning and content only grow (a tail
that may still turn into a marker is held back), a call's id and name go out once its name is complete,
then its arguments as the model writes them, so the fragments add up to the final arguments."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from spyre_runtime.entrypoints.chat.tool_parsers import PartialCall
from spyre_runtime.entrypoints.chat.tools import TEXT, ToolPlan


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text

    def as_dict(self) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ParsedOutput:
    reasoning: str | None
    content: str | None
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class CallDelta:
    """Part of call `index`: the first one carries its id and name (arguments ""), later ones arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    calls: tuple[CallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class OutputParser:
    """One request's way of reading its choices' text. `reasoning`: a reasoning parser or None;
    `include_reasoning` false drops the reasoning from what is sent (vLLM's include_reasoning)."""

    def __init__(self, tools: ToolPlan = TEXT, reasoning=None, include_reasoning: bool = True) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self.include_reasoning = include_reasoning

    @property
    def has_reasoning(self) -> bool:
        return self.reasoning is not None

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning, the rest): reasoning is None without a reasoning parser."""
        if self.reasoning is None:
            return None, text
        reasoning, rest = self.reasoning.split(text, final)
        return (reasoning if self.include_reasoning or reasoning is None else ""), rest

    def calls_of(self, content: str, final: bool) -> tuple[str, tuple[PartialCall, ...]]:
        """(content, calls) of the text after the reasoning."""
        plan = self.tools
        if plan.mode == "named":  # the call starts with its arguments (after any reasoning)
            return "", (PartialCall(plan.function, content, final),) if content or final else ()
        if plan.parser is None:
            return content, ()
        parse = plan.parser.parse(content, final)
        calls = parse.calls if plan.parallel else parse.calls[:1]
        return parse.content, calls

    def final(self, text: str) -> ParsedOutput:
        reasoning, rest = self.split(text, final=True)
        content, calls = self.calls_of(rest, final=True)
        shown = reasoning if self.include_reasoning else None
        if not calls:
            return ParsedOutput(shown, None if reasoning is not None and not content else content)
        named = tuple(ToolCall(new_call_id(), c.name, c.arguments) for c in calls)
        return ParsedOutput(shown, content if content.strip() else None, named)

    def stream(self) -> OutputStream:
        return OutputStream(self)


@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class OutputStream:
    """One choice's stream: `feed` the whole text so far, get what is new."""

    parser: OutputParser
    reasoning: str = ""
    content: str = ""
    calls: list[_SentCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str, final: bool) -> OutputDelta:
        reasoning, rest = self.parser.split(text, final)
        content, calls = self.parser.calls_of(rest, final)
        delta_reasoning = _grown(self.reasoning, reasoning or "")
        self.reasoning += delta_reasoning
        if self.calls and not calls:
            return OutputDelta(delta_reasoning)  # malformed after a call went out: the stream keeps it
        delta_content = _grown(self.content, content)
        self.content += delta_content
        return OutputDelta(delta_reasoning, delta_content, tuple(self._call_deltas(calls)))

    def _call_deltas(self, calls: tuple[PartialCall, ...]) -> list[CallDelta]:
        out = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # calls go out in order, each once its name is known
            if index == len(self.calls):
                sent = _SentCall(new_call_id(), call.name)
                self.calls.append(sent)
                out.append(CallDelta(index, sent.id, sent.name))
            sent = self.calls[index]
            more = _grown(sent.arguments, call.arguments)
            if more:
                sent.arguments += more
                out.append(CallDelta(index, arguments=more))
        return out

    def sent(self) -> ParsedOutput:
        """Everything this stream has sent, as one output (for the events that close a stream)."""
        calls = tuple(ToolCall(c.id, c.name, c.arguments) for c in self.calls)
        content = self.content if not calls or self.content.strip() else None
        return ParsedOutput(self.reasoning if self.parser.has_reasoning else None, content, calls)


def _grown(sent: str, now: str) -> str:
    """What `now` adds to what was sent (nothing if it is not an extension, which the parsers avoid)."""
    return now[len(sent) :] if now.startswith(sent) else ""
