"""Mistral: content, then `[TOOL_CALLS]` (a special token: the text must keep special tokens) and either
a JSON array of {"name", "arguments"} objects (tokenizers before v11) or each call after its own
`[TOOL_CALLS]`, as `name[ARGS]{...arguments...}` (v11 on; `[ARGS]` is a special token too, and a
`[CALL_ID]<id>` may stand before it) or as `name{...arguments...}`."""

from __future__ import annotations

import re

from spyre_runtime.entrypoints.chat.tool_parsers.base import ToolParser
from spyre_runtime.entrypoints.chat.tool_parsers.json_array import scan_array
from spyre_runtime.entrypoints.chat.tool_parsers.json_scan import CallScan, Malformed, scan_value, skip_ws

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = re.compile(r"\[CALL_ID\][A-Za-z0-9]*")
NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS,)
    needs_special_tokens = True

    def scan_calls(self, text: str, start: int) -> list[CallScan]:
        j = skip_ws(text, start + len(TOOL_CALLS))
        if j < len(text) and text[j] == "[":
            return scan_array(text, j)
        calls: list[CallScan] = []
        while j < len(text):
            call = _named_call(text, j)
            calls.append(call)
            if call.end is None:
                break
            j = skip_ws(text, call.end)
            if not text.startswith(TOOL_CALLS, j):
                break
            j = skip_ws(text, j + len(TOOL_CALLS))
        return calls


def _named_call(text: str, i: int) -> CallScan:
    """`name{...}` or `name[ARGS]{...}` (or `name[CALL_ID]id[ARGS]{...}`) at text[i]: the name is complete
    once the arguments open."""
    match = NAME.match(text, i)
    end = match.end() if match else i
    if match and (call_id := CALL_ID.match(text, end)) and call_id.end() < len(text):
        end = call_id.end()
    if match and text.startswith(ARGS, end):
        end += len(ARGS)
    rest = text[end:]
    growing = any(m.startswith(rest) for m in (ARGS, "[CALL_ID]")) or CALL_ID.fullmatch(rest)
    if not rest or (match and growing):
        return CallScan(None, None, None, None)  # the name, an id or [ARGS] may still be growing
    if not match or text[end] != "{":
        raise Malformed(f"expected name{{arguments}} or name[ARGS]{{arguments}} at {i}")
    args_end = scan_value(text, end)
    return CallScan(match.group(), end, args_end, args_end)
