"""Calls as one JSON array of {"name": ..., "arguments": {...}} objects, optionally after a marker: IBM
Granite 3.x (`<|tool_call|>` or `<tool_call>`, then the array; the whole output is the calls), Mistral before
its v11 tokenizer (content, then `[TOOL_CALLS]` and the array) and the array our `tool_choice: required`
grammar writes (keys name and parameters, nothing before it)."""

from __future__ import annotations

from spyre_runtime.entrypoints.chat.tool_parsers.base import ToolParser, leading_start
from spyre_runtime.entrypoints.chat.tool_parsers.json_scan import CallScan, Malformed, scan_call, skip_ws


def scan_array(text: str, i: int) -> list[CallScan]:
    """The call objects of the array opening at text[i] (calls so far while it is open)."""
    if text[i] != "[":
        raise Malformed("expected '['")
    calls: list[CallScan] = []
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "]" and not calls:
            break
        if text[j] != "{":
            raise Malformed(f"expected a call object at {j}")
        call = scan_call(text, j)
        calls.append(call)
        if call.end is None:
            break
        j = skip_ws(text, call.end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
        elif j < len(text) and text[j] != "]":
            raise Malformed(f"expected ',' or ']' at {j}")
        elif j < len(text):
            break
    return calls


def skip_marker(text: str, i: int, markers: tuple[str, ...]) -> int:
    for marker in markers:
        if text.startswith(marker, i):
            return skip_ws(text, i + len(marker))
    return i


class GraniteToolParser(ToolParser):
    """`<|tool_call|>[{"name": "f", "arguments": {...}}]` (Granite 3.0; 3.1+ write `<tool_call>`)."""

    name = "granite"
    openers = ("<|tool_call|>", "<tool_call>")

    def find_start(self, text: str) -> tuple[int | None, bool]:
        return leading_start(text, (*self.openers, "["))

    def scan_calls(self, text: str, start: int) -> list[CallScan]:
        i = skip_marker(text, start, self.openers)
        return scan_array(text, i) if i < len(text) else []


class RequiredToolParser(GraniteToolParser):
    """What the `tool_choice: required` grammar writes: `[{"name": "f", "parameters": {...}}, ...]`."""

    name = "required"
    openers = ()
