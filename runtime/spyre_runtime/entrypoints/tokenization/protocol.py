"""vLLM's /tokenize and /detokenize requests as strict schemas."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from spyre_runtime.entrypoints.chat.protocol import MAX_MESSAGES, ChatMessage, Tool
from spyre_runtime.entrypoints.server.protocol import StrictModel


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = Field(default=None, max_length=100_000)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)
