"""A scanner for JSON that may still be growing: where a value ends (or that the text ends inside it), and
the `name` and arguments of a tool-call object, read while the model is still writing it. It never guesses
how a value will end: arguments are the model's own text, so streamed fragments add up to the final one.

    scan_value(text, i)  -> the end of the value at i, None when the text ends inside it
    scan_call(text, i)   -> CallScan: the name (once its string is closed), the arguments' span, the end
Either raises Malformed when the text cannot be what it should (then it is not a tool call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
CLOSING = {"{": "}", "[": "]"}
LITERAL_CHARS = frozenset("+-0123456789.eEtruefalsn")


class Malformed(ValueError):
    """The text is not the JSON it should be."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def scan_string(text: str, i: int) -> int | None:
    """text[i] is '"': the index after the closing quote, None when the text ends first."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def scan_value(text: str, i: int) -> int | None:
    """The index after the JSON value starting at i, None when the text ends inside it."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return scan_string(text, i)
    if c in CLOSING:
        stack = []
        j = i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = scan_string(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in CLOSING:
                stack.append(CLOSING[c])
            elif c in "}]":
                if not stack or stack.pop() != c:
                    raise Malformed(f"unbalanced {c!r} at {j}")
                if not stack:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] in LITERAL_CHARS:
        j += 1
    if j == i:
        raise Malformed(f"no JSON value at {i}")
    return None if j == len(text) else j


@dataclass(frozen=True)
class CallScan:
    """One tool-call object as far as the text goes. `args_start`: where the arguments object starts (None
    until its key is read); `args_end`: after it (None while open); `end`: after the call's object."""

    name: str | None
    args_start: int | None
    args_end: int | None
    end: int | None

    def arguments(self, text: str) -> str:
        if self.args_start is None:
            return ""
        return text[self.args_start : self.args_end if self.args_end is not None else len(text)]


def scan_call(text: str, i: int, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> CallScan:
    """The object at text[i] ('{') read as {"name": "...", "arguments": {...}} (keys in any order, other
    keys allowed); Malformed when it cannot be one."""
    name = args_start = args_end = None

    def partial() -> CallScan:
        return CallScan(name, args_start, args_end, None)

    j = skip_ws(text, i + 1)
    while True:
        if j >= len(text):
            return partial()
        if text[j] == "}":
            break
        if text[j] != '"':
            raise Malformed(f"expected a key at {j}")
        key_end = scan_string(text, j)
        if key_end is None:
            return partial()
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return partial()
        if text[j] != ":":
            raise Malformed(f"expected ':' at {j}")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return partial()
        value_end = scan_value(text, j)
        if key == "name":
            if text[j] != '"':
                raise Malformed("the name is not a string")
            if value_end is not None:
                name = json.loads(text[j:value_end])
        elif key in arg_keys:
            if text[j] != "{":
                raise Malformed("the arguments are not an object")
            args_start, args_end = j, value_end
        if value_end is None:
            return partial()
        j = skip_ws(text, value_end)
        if j >= len(text):
            return partial()
        if text[j] == ",":
            j = skip_ws(text, j + 1)
        elif text[j] != "}":
            raise Malformed(f"expected ',' or '}}' at {j}")
    if not name:
        raise Malformed("a tool call without a name")
    return CallScan(name, args_start, args_end, j + 1)
