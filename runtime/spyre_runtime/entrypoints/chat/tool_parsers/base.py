"""What every tool-call parser shares. A parser knows one model family's layout: where its calls start
(`find_start`) and how the calls after that point are laid out (`scan_calls`); the base turns that into a
`ToolParse` of the text so far, the same function for a finished text and a stream that is still growing:

    text ──find_start──► content (before the calls) | calls region ──scan_calls──► CallScan per call
         no start: content (a tail that may still become a start marker is held back while streaming)
         Malformed, or (finished) a call left open or arguments that are not a JSON object: all content
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

from spyre_runtime.entrypoints.chat.tool_parsers.json_scan import CallScan, Malformed

EMPTY_ARGUMENTS = "{}"


@dataclass(frozen=True)
class PartialCall:
    """A call as far as the text goes: the name once its string is closed, the arguments' JSON text so far
    (the model's own text, so it only grows)."""

    name: str | None
    arguments: str
    is_complete: bool


@dataclass(frozen=True)
class ToolParse:
    """`content`: the text that is content for sure; `calls`: the calls begun after it."""

    content: str
    calls: tuple[PartialCall, ...] = ()


def held_back(text: str, markers: tuple[str, ...]) -> str:
    """`text` without a tail that could still grow into one of `markers`."""
    cut = len(text)
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:size]):
                cut = min(cut, len(text) - size)
                break
    return text[:cut]


def leading_start(text: str, starts: tuple[str, ...]) -> tuple[int | None, bool]:
    """For layouts whose calls open the output: (where the calls start, or None; whether the text so far
    may still become such a start, so it is held back)."""
    i = len(text) - len(text.lstrip())
    rest = text[i:]
    if any(rest.startswith(s) for s in starts):
        return i, False
    return None, any(s.startswith(rest) for s in starts)


def complete_arguments(scan: CallScan, text: str) -> str:
    """A finished call's arguments, checked: a JSON object (none given: `{}`)."""
    arguments = scan.arguments(text) or EMPTY_ARGUMENTS
    if not isinstance(json.loads(arguments), dict):
        raise Malformed("the arguments are not a JSON object")
    return arguments


class ToolParser:
    """One model family's tool-call layout. `markers`: strings that open calls anywhere in the text;
    `needs_special_tokens`: its marker is a special token, so the text must keep special tokens."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()
    needs_special_tokens: ClassVar[bool] = False

    def find_start(self, text: str) -> tuple[int | None, bool]:
        """(where the calls start or None, whether the whole text must be held back while streaming)."""
        at = [i for i in (text.find(m) for m in self.markers) if i != -1]
        return (min(at), False) if at else (None, False)

    def scan_calls(self, text: str, start: int) -> list[CallScan]:
        """The calls from `start` on; raises Malformed when the text there is not this layout."""
        raise NotImplementedError

    def parse(self, text: str, final: bool) -> ToolParse:
        start, hold_all = self.find_start(text)
        if start is None:
            if final:
                return ToolParse(text)
            return ToolParse("" if hold_all else held_back(text, self.markers))
        try:
            scans = self.scan_calls(text, start)
            if final:
                if not scans or any(s.end is None for s in scans):
                    raise Malformed("the output ends inside a tool call")
                calls = tuple(PartialCall(s.name, complete_arguments(s, text), True) for s in scans)
            else:
                calls = tuple(_partial(s, text) for s in scans)
        except (Malformed, ValueError):
            return ToolParse(text)
        return ToolParse(text[:start], calls)


def _partial(scan: CallScan, text: str) -> PartialCall:
    done = scan.end is not None
    arguments = scan.arguments(text) or (EMPTY_ARGUMENTS if done else "")
    return PartialCall(scan.name, arguments, done)
