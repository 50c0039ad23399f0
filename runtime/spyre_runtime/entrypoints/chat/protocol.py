"""A chat's messages and tools as requests carry them (chat completions, /tokenize, and /v1/responses once
turned into a chat), as strict schemas; and what the chat pieces read of such a request (`ChatBody`,
`ToolsBody`)."""

from __future__ import annotations

from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from spyre_runtime.entrypoints.server.protocol import StrictModel

MAX_MESSAGES = 1024


class ImageURL(StrictModel):
    url: str | None = None  # a data: URL (images.py); checked there, so a 400 names the part
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None
    image_url: ImageURL | None = None  # an image-text model's input (images.py)
    # other part types (input_audio, file) are refused in Validator.messages


class ToolFunction(StrictModel):
    name: str = Field(max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: ToolFunction


class NamedFunction(StrictModel):
    name: str = Field(max_length=256)


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(StrictModel):
    name: str = Field(max_length=256)
    arguments: str


class ToolCallParam(StrictModel):
    """A tool call of an earlier assistant message, as the client sends it back."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)  # extras go to the template

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = Field(default=None, max_length=256)


class ChatBody(Protocol):
    """What the chat template is rendered from: a chat completions or a /tokenize request."""

    messages: list[ChatMessage] | None
    tools: list[Tool] | None
    add_special_tokens: bool | None
    add_generation_prompt: bool | None
    continue_final_message: bool | None
    chat_template: str | None
    chat_template_kwargs: dict[str, Any] | None


class ToolsBody(Protocol):
    """What a chat completions request says about tools."""

    tools: list[Tool] | None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None
    parallel_tool_calls: bool | None
