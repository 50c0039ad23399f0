"""The OpenAI API's completions and chat completions requests as strict schemas: strict types, no NaN,
bounded sizes, unknown parameters refused (those of OpenAI's or vLLM's API this server does not implement
with the reason, `UNSUPPORTED`). Nulls are accepted wherever a field is optional (many clients send
`"temperature": null`). A chat's messages and tools are chat/protocol.py's; the checks that need the
engine's limits are validator.py's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from spyre_runtime.entrypoints.chat.protocol import MAX_MESSAGES, ChatMessage, NamedToolChoice, Tool
from spyre_runtime.entrypoints.server.protocol import StrictModel
from spyre_runtime.sampling.params import MAX_LOGPROBS, SEED_MAX, SEED_MIN

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
MAX_PROMPTS = 64  # prompts in one completions request
MAX_SEQUENCES = 64  # prompts x best_of (or n) in one request
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 1000  # characters in one stop string
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries, as OpenAI

# Parameters of OpenAI's or vLLM's API this server does not implement: refused with a 400 that says so.
UNSUPPORTED = {
    "suffix": "suffix (insertion) is not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "functions": "functions is deprecated; use tools",
    "function_call": "function_call is deprecated; use tool_choice",
    "web_search_options": "web search is not supported",
    "guided_grammar": "guided_grammar is not supported; use guided_json, guided_regex or guided_choice",
    "structured_outputs": "use response_format, guided_json, guided_regex or guided_choice",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported",
    "prompt_logprobs": "prompt_logprobs is not supported on its own; use echo with logprobs",
    "documents": "documents is not supported",
    "mm_processor_kwargs": "multimodal input is not supported",
}


# ---- request schemas -------------------------------------------------------------------------------


class StreamOptions(StrictModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JSONSchemaFormat(StrictModel):
    name: str = Field(default="schema", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(StrictModel):
    model: str = Field(max_length=1024)
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = Field(default=None)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: Literal[True] | None = None
    add_special_tokens: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_SEQUENCES)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(default=None, max_length=10_000)
    guided_choice: list[str] | None = Field(default=None, min_length=1, max_length=256)
    guided_whitespace_pattern: None = None
    # vLLM's beam search: n beams (beam.py)
    use_beam_search: bool | None = None
    length_penalty: float | None = Field(default=None, ge=-10.0, le=10.0)
    early_stopping: bool | Literal["never"] | None = None
    # accepted and without effect on the output, as in OpenAI's API
    user: str | None = Field(default=None, max_length=1024)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    request_id: str | None = Field(default=None, max_length=256)
    priority: Literal[0] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_SEQUENCES)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None  # to the chat template
    include_reasoning: bool | None = None  # vLLM's: false leaves reasoning_content out
    chat_template: str | None = Field(default=None, max_length=100_000)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
