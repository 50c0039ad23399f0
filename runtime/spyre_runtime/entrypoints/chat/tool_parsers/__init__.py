"""Tool-call parsers, chosen by `--tool-call-parser` (vLLM's names): each reads one model family's way of
writing calls out of the generated text (base.ToolParser.parse), for whole and streamed responses alike."""

from __future__ import annotations

from spyre_runtime.entrypoints.chat.tool_parsers.base import PartialCall, ToolParse, ToolParser
from spyre_runtime.entrypoints.chat.tool_parsers.hermes import HermesToolParser
from spyre_runtime.entrypoints.chat.tool_parsers.json_array import GraniteToolParser, RequiredToolParser
from spyre_runtime.entrypoints.chat.tool_parsers.llama3_json import Llama3JsonToolParser
from spyre_runtime.entrypoints.chat.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (GraniteToolParser, HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

__all__ = ["TOOL_PARSERS", "PartialCall", "RequiredToolParser", "ToolParse", "ToolParser"]
