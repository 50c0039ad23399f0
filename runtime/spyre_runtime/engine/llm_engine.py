"""The engine: one step is schedule -> execute -> update. It owns the tokenizer-side output processing
(detokenization, stop conditions) and is driven either synchronously (`LLM`) or from a thread
(`EngineThread`, used by the server so requests are accepted while a batch computes)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from spyre_runtime.config import RuntimeConfig, load_config
from spyre_runtime.engine.continuous_scheduler import ContinuousScheduler
from spyre_runtime.engine.static_scheduler import StaticScheduler, check_admissible
from spyre_runtime.executor.graph_cache import warmup_with_cache
from spyre_runtime.executor.model_executor import ModelExecutor, configure_threads
from spyre_runtime.request import Request
from spyre_runtime.sampling.params import SamplingParams, TokenLogprob
from spyre_runtime.sampling.sampler import token_logprobs

log = logging.getLogger(__name__)


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
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


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


class LLMEngine:
    def __init__(self, config: RuntimeConfig, executor: ModelExecutor | None = None, tokenizer=None) -> None:
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_dir)
        self.executor = executor if executor is not None else ModelExecutor(config)
        self.scheduler = ContinuousScheduler(config) if config.use_cb else StaticScheduler(config.shapes)
        self.outputs = OutputProcessor(self.tokenizer, eos_token_ids(config.model_dir, self.tokenizer))
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.on_step: Callable[[object, float], None] | None = None  # (step, seconds) hook for metrics

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: those the model embeds and the tokenizer can decode."""
        model_vocab = self.executor.dims.vocab_size or len(self.tokenizer)
        return min(model_vocab, len(self.tokenizer))

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> Request:
        """Raises ValueError (nothing is queued) when the request can never run."""
        sampling = dataclasses.replace(sampling, eos_token_ids=tuple(sorted(self.outputs.eos_ids)))
        req = Request(request_id or self.new_request_id(), list(prompt_token_ids), sampling)
        check_admissible(self.scheduler, req)
        if sampling.guide is not None:
            req.guide = sampling.guide.new_guide()
        if sampling.prompt_logprobs is not None:
            req.prompt_logprobs = self.score_prompt(req.prompt_token_ids, sampling.prompt_logprobs)
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        return req

    def score_prompt(self, token_ids: list[int], num_top: int) -> list[TokenLogprob | None]:
        """Each prompt token's logprob given the tokens before it (None for the first), with its rank and
        the top `num_top` alternatives: an eager pass over the prompt, outside the compiled graphs."""
        logits = self.executor.score(token_ids)  # [L, V]
        if len(token_ids) < 2:
            return [None]
        logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
        chosen = torch.tensor(token_ids[1:], dtype=torch.long)
        return [None, *token_logprobs(logprobs, chosen, [num_top] * len(chosen))]

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        self.requests.pop(request_id, None)
        if req is None:
            return None
        return self.outputs.output(req)

    def fail(self, req: Request, error: BaseException) -> None:
        """Finishes one request with an error that is its own (the engine goes on)."""
        log.error("request %s failed: %s", req.request_id, error)
        req.error = f"{type(error).__name__}: {error}"
        req.finish("error")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def close(self, failed: bool = False) -> None:
        """Stops the tensor-parallel ranks; after a failure they may sit in a collective, so they are
        killed rather than asked."""
        if failed and self.executor.workers is not None:
            self.executor.workers.kill()
        self.executor.close()

    def step(self) -> list[RequestOutput]:
        """One step. An exception from here leaves the engine in an unknown state: the caller treats
        it as fatal. Failures that belong to one request (its grammar, its detokenization) fail only it."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        t0 = time.monotonic()
        for req in step.scheduled:
            if req.scheduled_time is None:
                req.scheduled_time = t0
        sampled = self.executor.execute(step)
        now = time.monotonic()
        live = [r for r in step.requests if not r.is_finished]
        for req, token, logprob in zip(step.requests, sampled.token_ids, sampled.logprobs, strict=True):
            try:
                self.outputs.append(req, token, logprob, now)
            except Exception as e:
                self.fail(req, e)
        outputs = [self.outputs.output(r) for r in live]
        for req in self.scheduler.update(step):
            self.requests.pop(req.request_id, None)
        if self.on_step is not None:
            self.on_step(step, now - t0)
        return outputs


class LLM:
    """Offline batch inference: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

    def __init__(
        self, model_dir: str | Path, warmup: bool = True, config: RuntimeConfig | None = None, **overrides
    ) -> None:
        """`overrides` are load_config's arguments (`environ=`, flags); or pass a ready `config`."""
        if config is None:
            environ = overrides.pop("environ", None)
            config = load_config(model_dir, environ=environ, **overrides)
        self.config = config
        configure_threads(self.config)
        self.engine = LLMEngine(self.config)
        self.warmup = warmup_with_cache(self.engine.executor, self.config) if warmup else None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stops the tensor-parallel ranks, if any."""
        self.engine.close()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One SamplingParams for all prompts, or one per prompt. Runs until every request finished."""
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        ids = [p if isinstance(p, list) else self.tokenizer(p)["input_ids"] for p in prompts]
        order = [self.engine.add_request(p, sp).request_id for p, sp in zip(ids, per_prompt, strict=True)]
        final: dict[str, RequestOutput] = {}
        while self.engine.has_work():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in order]


class EngineThread:
    """Runs the engine loop on its own thread. Commands come in through a queue; every RequestOutput is
    handed to `emit(output)` (the server forwards it to the event loop), a step's outputs together to
    `emit_step(outputs)` when given. An exception in a step kills the loop: `error` is set and
    `on_dead(error)` is called once, so the server can fail fast."""

    def __init__(
        self,
        engine: LLMEngine,
        emit: Callable[[RequestOutput], None],
        on_dead: Callable[[BaseException], None] | None = None,
        emit_step: Callable[[list[RequestOutput]], None] | None = None,
    ) -> None:
        self.engine = engine
        self.emit = emit
        self.emit_step = emit_step or (lambda outputs: [emit(out) for out in outputs])
        self.on_dead = on_dead
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def is_alive(self) -> bool:
        return self.error is None and self.thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self.thread.join(timeout=30)

    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str) -> None:
        self._commands.put(("add", (prompt_token_ids, sampling, request_id)))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = cmd
            if kind == "add":
                self._add(*arg)
            elif kind == "abort":
                out = self.engine.abort(arg)
                if out is not None:
                    self.emit(out)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str) -> None:
        try:
            self.engine.add_request(prompt_token_ids, sampling, request_id)
        except ValueError as e:  # the server checks first; a request that still cannot run fails alone
            req = Request(request_id, list(prompt_token_ids), sampling)
            self.engine.fail(req, e)
            self.emit(self.engine.outputs.output(req))

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_work())
                if self.engine.has_work():
                    self.emit_step(self.engine.step())
        except BaseException as e:  # surfaced through /health, every in-flight request and the exit code
            log.exception("engine loop failed; the engine is dead")
            self.error = e
            if self.on_dead is not None:
                self.on_dead(e)
