"""Reasoning parsers: where a model's reasoning ends and its answer begins, read from the text, for a
finished output and for a stream that is still growing (a tail that may still become a marker is held
back, so both parts only grow).

    deepseek_r1   [<think>] reasoning </think> answer   the template opens <think>: until </think> all is
                                                         reasoning
    qwen3         <think> reasoning </think> answer     reasoning only when the output opens <think>
    granite       Here is my thought process: reasoning Here is my response: answer   (or "Here's ...");
                  without the first marker all is answer

`split(text, final)` -> (reasoning or None when the output has no reasoning part, the answer so far).
`end_markers`: the strings that end the reasoning (structured output starts after one of them).
"""

from __future__ import annotations

from typing import ClassVar

from spyre_runtime.entrypoints.chat.tool_parsers.base import held_back


class MarkerReasoningParser:
    """Reasoning between an opening and a closing marker (one of several spellings each)."""

    name: ClassVar[str]
    start_markers: ClassVar[tuple[str, ...]]
    end_markers: ClassVar[tuple[str, ...]]
    implicit_start: ClassVar[bool] = False  # reasoning from the first token, marker or not

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        lead = len(text) - len(text.lstrip())
        rest = text[lead:]
        opened = next((m for m in self.start_markers if rest.startswith(m)), None)
        if opened is not None:
            body = rest[len(opened) :]
        elif not final and any(m.startswith(rest) for m in self.start_markers):
            return ("" if self.implicit_start else None), ""  # may still open the reasoning: wait
        elif self.implicit_start:
            body = text
        else:
            return None, text
        at = [(i, m) for m in self.end_markers if (i := body.find(m)) != -1]
        if not at:
            return (body if final else held_back(body, self.end_markers)), ""
        i, marker = min(at)
        return body[:i], body[i + len(marker) :]

    def count_tokens(self, token_ids: list[int], decode) -> int:
        """How many of the output's tokens its reasoning took: those up to the end of the closing marker
        (all of them while the reasoning is open; none without reasoning). `decode(ids)` -> their text."""
        text = decode(token_ids)
        reasoning, answer = self.split(text, True)
        if reasoning is None:
            return 0
        start = len(text) - len(answer)  # where the answer begins
        if not any(text[:start].endswith(m) for m in self.end_markers):
            return len(token_ids)
        low, high = 0, len(token_ids)
        while low < high:  # the fewest tokens whose text reaches the answer
            mid = (low + high) // 2
            if len(decode(token_ids[:mid])) >= start:
                high = mid
            else:
                low = mid + 1
        return low


class DeepSeekR1ReasoningParser(MarkerReasoningParser):
    name = "deepseek_r1"
    start_markers = ("<think>",)
    end_markers = ("</think>",)
    implicit_start = True


class Qwen3ReasoningParser(MarkerReasoningParser):
    name = "qwen3"
    start_markers = ("<think>",)
    end_markers = ("</think>",)


class GraniteReasoningParser(MarkerReasoningParser):
    name = "granite"
    start_markers = ("Here is my thought process:", "Here's my thought process:")
    end_markers = ("Here is my response:", "Here's my response:")
