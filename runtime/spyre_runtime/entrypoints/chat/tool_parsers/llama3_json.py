"""Llama 3.1-3.3 (and 4) JSON tool calls: the output is `{"name": "f", "parameters": {...}}` (or
`"arguments"`), several joined by `;`, optionally after `<|python_tag|>`; text after the last call is
dropped."""

from __future__ import annotations

from spyre_runtime.entrypoints.chat.tool_parsers.base import ToolParser, leading_start
from spyre_runtime.entrypoints.chat.tool_parsers.json_scan import CallScan, scan_call, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def find_start(self, text: str) -> tuple[int | None, bool]:
        return leading_start(text, (PYTHON_TAG, "{"))

    def scan_calls(self, text: str, start: int) -> list[CallScan]:
        j = skip_ws(text, start + len(PYTHON_TAG)) if text.startswith(PYTHON_TAG, start) else start
        calls: list[CallScan] = []
        while j < len(text) and text[j] == "{":
            call = scan_call(text, j)
            calls.append(call)
            if call.end is None:
                break
            j = skip_ws(text, call.end)
            if j < len(text) and text[j] == ";":
                j = skip_ws(text, j + 1)
            else:
                break
        return calls
