"""OpenAI's Responses API request (`POST /v1/responses`) as a strict schema, like protocol.py's: strict
types, bounded sizes, unknown parameters refused (those of OpenAI's API this server does not implement with
the reason, `RESPONSES_UNSUPPORTED`). Input items are checked one by one in input.py, so a bad
item gets a 400 naming it (`input.3.call_id`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from spyre_runtime.entrypoints.chat.protocol import MAX_MESSAGES
from spyre_runtime.entrypoints.server.protocol import StrictModel
from spyre_runtime.sampling.params import SEED_MAX, SEED_MIN

RESPONSES_UNSUPPORTED = {
    "background": "background responses are not supported",
    "conversation": "conversations are not supported; send the input items, or previous_response_id",
    "context_management": "context management is not supported",
    "prompt_cache_retention": "prompt_cache_retention is not supported (the prefix cache needs no hint)",
    "prompt_cache_options": "prompt_cache_options is not supported (the prefix cache needs no hint)",
    "top_logprobs": "logprobs are not returned by /v1/responses; use /v1/chat/completions",
    "max_tool_calls": "max_tool_calls is not supported",
}


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str = Field(max_length=256)


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(StrictModel):
    model: str | None = Field(default=None, max_length=1024)
    input: str | list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = Field(default=None, max_length=256)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = Field(default=None, max_length=16)
    truncation: Literal["disabled"] | None = None
    # vLLM's sampling extras
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    top_k: int | None = Field(default=None, ge=-1)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    # accepted and without effect on the output, as in OpenAI's API
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=1024)
    safety_identifier: str | None = Field(default=None, max_length=1024)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    service_tier: str | None = None
