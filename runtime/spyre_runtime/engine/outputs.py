"""What the engine hands back, and the tokenizer side of it: sampled tokens appended to their requests,
detokenized incrementally, stop conditions (EOS, stop strings and token ids, length) decided, and each
request's progress as a `RequestOutput` carrying only what is new since the previous one."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

from spyre_runtime.request import Request
from spyre_runtime.sampling.params import TokenLogprob


@dataclass(frozen=True)
class RequestOutput:
    """What a request produced so far. `delta_*` is what is new since the previous output."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    delta_text: str
    delta_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    timings: RequestTimings | None = None  # set on the final output
    logprobs: tuple[TokenLogprob, ...] = ()  # per output token so far, when asked
    delta_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # on the final output, when asked
    error: str | None = None  # finish_reason "error": what went wrong
    stop_reason: str | int | None = None  # the stop string or stop token id that ended the request
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


@dataclass(frozen=True)
class RequestTimings:
    arrival: float
    scheduled: float | None
    first_token: float | None
    finished: float
    token_times: tuple[float, ...]

    @property
    def queue_seconds(self) -> float | None:
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def ttft_seconds(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itl_seconds(self) -> list[float]:
        """The gaps between the steps that gave tokens (kept n-gram drafts come in their row's step, as one
        iteration's tokens do in vLLM's)."""
        times = sorted(set(self.token_times))
        return [b - a for a, b in itertools.pairwise(times)]


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def eos_token_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    return frozenset(ids)


DETOKENIZE_CONTEXT = 5  # prompt tokens decoded before the output, so its first token keeps its leading space


def decode_output(tokenizer, prompt_ids: list[int], output_ids: list[int], skip_special_tokens: bool) -> str:
    """The text of `output_ids` as it reads after the prompt. SentencePiece tokenizers drop the leading
    space of a sequence's first token, so the output is decoded after the prompt's last few tokens and
    their text is cut off (vLLM's rule)."""
    context = prompt_ids[-DETOKENIZE_CONTEXT:]
    if not context:
        return tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    prefix = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(context + output_ids, skip_special_tokens=skip_special_tokens)
    if full.startswith(prefix) and not prefix.endswith("\ufffd"):
        return full[len(prefix) :]
    return tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)


class OutputProcessor:
    """Appends sampled tokens to requests, detokenizes, and decides when each request stops."""

    def __init__(self, tokenizer, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self._sent: dict[str, tuple[int, int]] = {}  # request_id -> (chars sent, tokens sent)

    def append(self, req: Request, token: int, logprob: TokenLogprob | None, now: float) -> None:
        if req.is_finished:
            return
        if req.guide is not None and req.guide.is_complete:
            # the structure is finished (EOS was held back by min_tokens or ignore_eos): nothing may follow
            req.finish("stop")
            return
        req.output_token_ids.append(token)
        req.token_times.append(now)
        if logprob is not None:
            req.logprobs.append(logprob)
        if req.first_token_time is None:
            req.first_token_time = now
        params = req.sampling
        if req.guide is not None:
            req.guide.accept(token)  # raises GuideError when the grammar rejects the token
        may_stop = req.num_output_tokens >= params.min_tokens
        stop_token = (not params.ignore_eos and token in self.eos_ids) or token in params.stop_token_ids
        if may_stop and stop_token:
            kept = req.output_token_ids if params.include_stop_str_in_output else req.output_token_ids[:-1]
            req.output_text = self._decode(req, kept)
            if token in params.stop_token_ids:
                req.stop_reason = token
            req.finish("stop")
            return
        text = self._decode(req, req.output_token_ids)
        if may_stop:
            for stop in params.stop:
                at = text.find(stop)
                if at != -1:
                    req.output_text = (
                        text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
                    )
                    req.stop_reason = stop
                    req.finish("stop")
                    return
        req.output_text = text
        if req.num_output_tokens >= params.max_tokens:
            req.finish("length")

    def _decode(self, req: Request, ids: list[int]) -> str:
        return decode_output(self.tokenizer, req.prompt_token_ids, ids, req.sampling.skip_special_tokens)

    def output(self, req: Request) -> RequestOutput:
        chars, tokens = self._sent.get(req.request_id, (0, 0))
        text = req.output_text
        if not req.is_finished and req.sampling.stop:
            # hold back a tail that could still turn out to be the start of a stop string
            hold = max(len(s) for s in req.sampling.stop) - 1
            visible = max(chars, len(text) - hold)
        else:
            visible = len(text)
        if text.endswith("\ufffd") and not req.is_finished:
            visible = min(visible, len(text) - 1)  # an incomplete UTF-8 sequence: wait for the next token
        visible = max(visible, chars)
        out = RequestOutput(
            request_id=req.request_id,
            text=text[:visible],
            token_ids=tuple(req.output_token_ids),
            delta_text=text[chars:visible],
            delta_token_ids=tuple(req.output_token_ids[tokens:]),
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            timings=_timings(req) if req.is_finished else None,
            logprobs=tuple(req.logprobs),
            delta_logprobs=tuple(req.logprobs[tokens:]),
            prompt_logprobs=tuple(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            error=req.error,
            stop_reason=req.stop_reason,
            num_cached_tokens=req.num_cached_tokens,
        )
        if req.is_finished:
            self._sent.pop(req.request_id, None)
        else:
            self._sent[req.request_id] = (visible, req.num_output_tokens)
        return out

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


def _timings(req: Request) -> RequestTimings:
    return RequestTimings(
        arrival=req.arrival_time,
        scheduled=req.scheduled_time,
        first_token=req.first_token_time,
        finished=time.monotonic(),
        token_times=tuple(req.token_times),
    )
