"""Hermes 2 Pro and the many models trained on its format (Qwen 2.5/3, Granite 4): content, then each call
as `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`; text after the last call is dropped."""

from __future__ import annotations

from spyre_runtime.entrypoints.chat.tool_parsers.base import ToolParser
from spyre_runtime.entrypoints.chat.tool_parsers.json_scan import CallScan, Malformed, scan_call, skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (OPEN,)

    def scan_calls(self, text: str, start: int) -> list[CallScan]:
        calls: list[CallScan] = []
        j = start
        while text.startswith(OPEN, j):
            j = skip_ws(text, j + len(OPEN))
            if j >= len(text):
                break
            if text[j] != "{":
                raise Malformed(f"expected a call object at {j}")
            call = scan_call(text, j)
            calls.append(call)
            if call.end is None:
                break
            j = skip_ws(text, call.end)
            if text.startswith(CLOSE, j):
                j = skip_ws(text, j + len(CLOSE))
        return calls
