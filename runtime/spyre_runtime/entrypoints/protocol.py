"""The OpenAI API's requests, and every check of a request that can be made before it reaches the engine.

All of them are here, so the engine only ever sees input it can run: the JSON schemas (strict types, no
NaN, bounded sizes, unknown parameters refused), then `Validator` (model name, token ids inside the
vocabulary, the scheduler's shape and length limits, best_of within the batch, the sampling parameters,
the grammar of structured output). A failed check is an `APIError`: an OpenAI-style 4xx naming the
parameter. Nulls are accepted wherever a field is optional (many clients send `"temperature": null`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from spyre_runtime.sampling.params import MAX_LOGPROBS, SEED_MAX, SEED_MIN, SamplingParamError, SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
MAX_PROMPTS = 64  # prompts in one completions request
MAX_SEQUENCES = 64  # prompts x best_of (or n) in one request
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 1000  # characters in one stop string
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_MESSAGES = 1024
MAX_BODY_BYTES = 8 * 1024 * 1024

# Parameters of OpenAI's or vLLM's API this server does not implement: refused with a 400 that says so.
UNSUPPORTED = {
    "suffix": "suffix (insertion) is not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "functions": "functions is deprecated; use tools",
    "function_call": "function_call is deprecated; use tool_choice",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning models are not supported",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "guided_grammar": "guided_grammar is not supported; use guided_json, guided_regex or guided_choice",
    "structured_outputs": "use response_format, guided_json, guided_regex or guided_choice",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported",
    "prompt_logprobs": "prompt_logprobs is not supported on its own; use echo with logprobs",
    "documents": "documents is not supported",
    "mm_processor_kwargs": "multimodal input is not supported",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


OPEN_PATHS = frozenset({"/health", "/metrics"})  # reachable without the API key


def install_guards(app, api_key) -> None:
    """What both servers (decoders, pooling models) do before and around every route: the API key (Bearer)
    on everything but /health and /metrics, bodies of bounded size, APIError as an OpenAI error body.
    `api_key()` gives the key (None: open)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    app.add_middleware(_Guard, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        if e.status == 503:
            kind = "service_unavailable"
        return JSONResponse(error_body(e.message, kind, e.param, e.code), status_code=e.status)


class _Guard:
    """The API key and the body-size bound, as a plain ASGI middleware: Starlette's BaseHTTPMiddleware
    (`@app.middleware("http")`) relays every chunk of a streamed response through a task and a memory stream
    of its own, CPU the server shares with the engine's threads on every token."""

    def __init__(self, app, api_key) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope):
        import secrets

        from fastapi.responses import JSONResponse
        from starlette.datastructures import Headers

        headers = Headers(scope=scope)
        key = self.api_key()
        if key and scope["path"] not in OPEN_PATHS:
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
                body = error_body(
                    "invalid or missing API key", "authentication_error", code="invalid_api_key"
                )
                return JSONResponse(body, status_code=401)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            message = f"the request body is larger than {MAX_BODY_BYTES} bytes"
            return JSONResponse(error_body(message, "invalid_request_error"), status_code=413)
        return None


# ---- request schemas -------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JSONSchemaFormat(_Strict):
    name: str = Field(default="schema", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _SamplingFields(_Strict):
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
    # accepted and without effect on the output, as in OpenAI's API
    user: str | None = Field(default=None, max_length=1024)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    request_id: str | None = Field(default=None, max_length=256)
    priority: Literal[0] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_SEQUENCES)


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None
    # other part types (image_url, input_audio, file) are refused in Validator.messages


class ToolFunction(_Strict):
    name: str = Field(max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: ToolFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)  # extras go to the template

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template: str | None = Field(default=None, max_length=100_000)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


class TokenizeRequest(_Strict):
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


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


def param_of(loc: tuple) -> str | None:
    """A pydantic error location as the request parameter it names: ("body", "messages", 0, "content",
    "str") -> "messages.0.content" (union member tags dropped)."""
    parts = []
    for p in loc:
        if p == "body":
            continue
        if isinstance(p, str) and (p in {"str", "int", "float", "bool", "dict", "list"} or "[" in p):
            break
        parts.append(str(p))
    return ".".join(parts) or None


def extra_field_message(param: str) -> str:
    top = param.split(".")[0]
    if top in UNSUPPORTED:
        return f"{top}: {UNSUPPORTED[top]}"
    return f"{param}: unknown parameter (this server does not implement it)"


# ---- checks that need the engine's limits -----------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What the engine allows, read once at start-up."""

    served_model_name: str
    vocab_size: int  # token ids a prompt may hold
    max_batch: int  # sequences one engine step can hold (best_of bound)


@dataclass(frozen=True)
class Choice:
    """One sequence to generate: prompt `prompt_index`, choice `index` of the response."""

    index: int
    prompt_index: int
    params: SamplingParams


class Validator:
    """The checks of one request, in the order a reader would expect. `scheduler` answers shape and
    length limits (`can_admit`, `max_tokens_for`, `describe_limits`); `guides` compiles grammars."""

    def __init__(self, limits: Limits, scheduler, guides) -> None:
        self.limits = limits
        self.scheduler = scheduler
        self.guides = guides

    def model(self, name: str | None) -> None:
        if name is not None and name != self.limits.served_model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.limits.served_model_name!r}",
                "model",
                "model_not_found",
            )

    def token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.limits.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(param, f"token id {bad} is outside the vocabulary [0, {vocab})")

    def prompt_shape(self, body: CompletionRequest) -> list[str] | list[list[int]]:
        """The prompt(s) as a list of strings or of token id lists (at least one, none empty)."""
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise bad_request("prompt", "the prompt is empty")
        if len(prompts) > MAX_PROMPTS:
            raise bad_request("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        if any(len(p) == 0 for p in prompts):
            raise bad_request("prompt", "the prompt is empty")
        return prompts

    def messages(self, body: ChatCompletionRequest | TokenizeRequest) -> list[dict]:
        """Messages as plain dicts for the chat template; only text content parts."""
        out = []
        for i, m in enumerate(body.messages or ()):
            msg = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        raise bad_request(
                            f"messages.{i}.content.{j}",
                            f"content parts of type {part.type!r} are not supported (only text)",
                        )
                msg["content"] = "".join(part.text for part in m.content)
            elif m.content is None:
                msg["content"] = ""
            out.append(msg)
        return out

    def tool_choice(self, body: ChatCompletionRequest) -> None:
        if isinstance(body.tool_choice, dict):
            raise bad_request(
                "tool_choice",
                "only 'auto' and 'none' are supported: tools reach the chat template, and tool calls are "
                "returned as text (not parsed)",
            )

    def sampling(self, body: _SamplingFields, num_prompt_tokens: int, chat: bool) -> SamplingParams:
        """The request's SamplingParams; checks the lengths against the scheduler's limits."""
        max_tokens = (body.max_completion_tokens if chat else None) or body.max_tokens
        room = self.scheduler.max_tokens_for(num_prompt_tokens)
        if max_tokens is None:
            default = room if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
            max_tokens = max(1, min(default, room))
        if not self.scheduler.can_admit(num_prompt_tokens, max_tokens):
            raise APIError(
                400,
                f"the request ({num_prompt_tokens} prompt tokens, max_tokens={max_tokens}) "
                f"{self.scheduler.describe_limits()}",
                "max_tokens" if room > 0 else "prompt",
            )
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options", "only allowed when stream is true")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
        if len(stop) > MAX_STOP:
            raise bad_request("stop", f"at most {MAX_STOP} stop strings")
        if any(not s for s in stop):
            raise bad_request("stop", "stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stop):
            raise bad_request("stop", f"a stop string has at most {MAX_STOP_CHARS} characters")
        stop_ids = list(body.stop_token_ids or ())
        self.token_ids(stop_ids, "stop_token_ids")
        bias = []
        for key, value in (body.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request("logit_bias", f"keys are token ids, got {key!r}") from None
            self.token_ids([token], "logit_bias")
            bias.append((token, value))
        min_tokens = body.min_tokens or 0
        if min_tokens > max_tokens:
            raise bad_request("min_tokens", f"must be at most max_tokens ({max_tokens}), got {min_tokens}")
        if chat:
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            if body.top_logprobs and not body.logprobs:
                raise bad_request("top_logprobs", "needs logprobs: true")
        else:
            logprobs = body.logprobs
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_k=body.top_k or 0,
                top_p=1.0 if body.top_p is None else body.top_p,
                min_p=body.min_p or 0.0,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                logit_bias=tuple(bias),
                seed=body.seed,
                stop=tuple(stop),
                stop_token_ids=tuple(stop_ids),
                include_stop_str_in_output=bool(body.include_stop_str_in_output),
                ignore_eos=bool(body.ignore_eos),
                skip_special_tokens=body.skip_special_tokens is not False,
                logprobs=logprobs,
                prompt_logprobs=(
                    body.logprobs if not chat and body.echo and body.logprobs is not None else None
                ),
                guide=self.guide(body),
            )
        except SamplingParamError as e:
            raise bad_request(e.param, str(e).removeprefix(e.param + " ")) from None

    def guide(self, body: _SamplingFields):
        asked = []
        rf = body.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "json_schema":
                if rf.json_schema is None or rf.json_schema.schema_ is None:
                    raise bad_request("response_format", "json_schema needs json_schema.schema")
                asked.append(("response_format", "json_schema", rf.json_schema.schema_))
            else:
                asked.append(("response_format", "json_object", None))
        if body.guided_json is not None:
            asked.append(("guided_json", "json_schema", body.guided_json))
        if body.guided_regex is not None:
            asked.append(("guided_regex", "regex", body.guided_regex))
        if body.guided_choice is not None:
            if any(not c for c in body.guided_choice):
                raise bad_request("guided_choice", "choices must not be empty")
            asked.append(("guided_choice", "choice", body.guided_choice))
        if not asked:
            return None
        if len(asked) > 1:
            names = ", ".join(a[0] for a in asked)
            raise bad_request(asked[1][0], f"only one kind of structured output per request (got {names})")
        param, kind, value = asked[0]
        try:
            return self.guides.compile(kind, value)
        except ValueError as e:
            raise bad_request(param, str(e)) from None

    def choices(self, body: _SamplingFields, params: SamplingParams, prompt_index: int) -> list[Choice]:
        """n (or best_of) sequences for one prompt; seeded choices get seed + i, as vLLM does."""
        n = body.n or 1
        best_of = getattr(body, "best_of", None) or n
        if best_of < n:
            raise bad_request("best_of", f"must be at least n ({n}), got {best_of}")
        if best_of > n:
            if body.stream:
                raise bad_request("best_of", "cannot be used with stream (choices are picked at the end)")
            if best_of > self.limits.max_batch:
                raise bad_request(
                    "best_of", f"must be at most the engine's batch size ({self.limits.max_batch})"
                )
        count = best_of
        out = []
        for i in range(count):
            p = params
            if best_of > n and p.logprobs is None:
                p = _replace(p, logprobs=0)  # ranking needs each token's logprob
            if p.seed is not None and i:
                p = _replace(p, seed=(p.seed + i - SEED_MIN) % 2**64 + SEED_MIN)  # wraps in int64
            out.append(Choice(i, prompt_index, p))
        return out

    def num_sequences(self, num_prompts: int, body: _SamplingFields) -> None:
        per_prompt = max(body.n or 1, getattr(body, "best_of", None) or 1)
        if num_prompts * per_prompt > MAX_SEQUENCES:
            raise bad_request(
                "n",
                f"prompts x max(n, best_of) must be at most {MAX_SEQUENCES}, got {num_prompts * per_prompt}",
            )


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, **changes)
