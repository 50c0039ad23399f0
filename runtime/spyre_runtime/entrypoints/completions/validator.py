"""Every check of a decoder request that needs the engine's limits, made before the request reaches the
engine, so the engine only ever sees input it can run: `Validator` (model name, token ids inside the
vocabulary, the scheduler's shape and length limits, best_of within the batch, the sampling parameters, the
grammar of structured output). A failed check is an `APIError`: an OpenAI-style 4xx naming the parameter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from spyre_runtime.entrypoints.chat.tools import TEXT, ToolPlan
from spyre_runtime.entrypoints.completions.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_PROMPTS,
    MAX_SEQUENCES,
    MAX_STOP,
    MAX_STOP_CHARS,
    CompletionRequest,
    SamplingFields,
)
from spyre_runtime.entrypoints.server.errors import APIError, bad_request, model_not_found
from spyre_runtime.sampling.params import SEED_MIN, SamplingParamError, SamplingParams


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
            raise model_not_found(name, self.limits.served_model_name)

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

    def sampling(
        self,
        body: SamplingFields,
        num_prompt_tokens: int,
        chat: bool,
        tools: ToolPlan = TEXT,
        reasoning_end: tuple[str, ...] = (),
    ) -> SamplingParams:
        """The request's SamplingParams; checks the lengths against the scheduler's limits. `tools`: the
        grammar a tool choice enforces, and whether its parser needs special tokens in the text;
        `reasoning_end`: a grammar starts once the output holds one of these (the reasoning is over)."""
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
                skip_special_tokens=body.skip_special_tokens is not False and not tools.needs_special_tokens,
                logprobs=logprobs,
                prompt_logprobs=(
                    body.logprobs if not chat and body.echo and body.logprobs is not None else None
                ),
                guide=self.guide(body, tools.guide, reasoning_end),
            )
        except SamplingParamError as e:
            raise bad_request(e.param, str(e).removeprefix(e.param + " ")) from None

    def guide(self, body: SamplingFields, tool_guide: tuple | None = None, after: tuple[str, ...] = ()):
        asked = [tool_guide] if tool_guide else []
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
            spec = self.guides.compile(kind, value)
        except ValueError as e:
            raise bad_request(param, str(e)) from None
        return self.guides.defer(spec, after) if after else spec

    def choices(self, body: SamplingFields, params: SamplingParams, prompt_index: int) -> list[Choice]:
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

    def num_sequences(self, num_prompts: int, body: SamplingFields) -> None:
        per_prompt = max(body.n or 1, getattr(body, "best_of", None) or 1)
        if num_prompts * per_prompt > MAX_SEQUENCES:
            raise bad_request(
                "n",
                f"prompts x max(n, best_of) must be at most {MAX_SEQUENCES}, got {num_prompts * per_prompt}",
            )


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    return dataclasses.replace(params, **changes)
