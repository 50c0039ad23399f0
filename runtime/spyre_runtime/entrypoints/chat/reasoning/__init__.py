"""Reasoning parsers, chosen by `--reasoning-parser` (vLLM's names): they split a model's reasoning from
its answer, which becomes the message's content (and the text tool calls are read from)."""

from __future__ import annotations

from spyre_runtime.entrypoints.chat.reasoning.parsers import (
    DeepSeekR1ReasoningParser,
    GraniteReasoningParser,
    MarkerReasoningParser,
    Qwen3ReasoningParser,
)

REASONING_PARSERS: dict[str, type[MarkerReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, GraniteReasoningParser, Qwen3ReasoningParser)
}

__all__ = ["REASONING_PARSERS", "MarkerReasoningParser"]
