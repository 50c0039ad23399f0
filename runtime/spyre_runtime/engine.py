"""The engine: one step is schedule -> execute -> update. It owns the tokenizer-side output processing
(detokenization, stop conditions) and is driven either synchronously (`LLM`) or from a thread
(`EngineThread`, used by the server so requests are accepted while a batch computes)."""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spyre_runtime.cb_scheduler import ContinuousScheduler
from spyre_runtime.config import RuntimeConfig, load_config
from spyre_runtime.executor import ModelExecutor, configure_threads
from spyre_runtime.graph_cache import warmup_with_cache
from spyre_runtime.request import Request
from spyre_runtime.sampling import SamplingParams
from spyre_runtime.scheduler import StaticScheduler

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
    finish_reason: str | None
    num_prompt_tokens: int
    timings: RequestTimings | None = None  # set on the final output


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


class OutputProcessor:
    """Appends sampled tokens to requests, detokenizes, and decides when each request stops."""

    def __init__(self, tokenizer, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self._sent: dict[str, tuple[int, int]] = {}  # request_id -> (chars sent, tokens sent)

    def append(self, req: Request, token: int, now: float) -> None:
        if req.is_finished:
            return
        req.output_token_ids.append(token)
        req.token_times.append(now)
        if req.first_token_time is None:
            req.first_token_time = now
        params = req.sampling
        text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        if not params.ignore_eos and token in self.eos_ids:
            req.output_text = text
            req.finish("stop")
            return
        if token in params.stop_token_ids:
            req.output_text = text
            req.finish("stop")
            return
        for stop in params.stop:
            at = text.find(stop)
            if at != -1:
                req.output_text = text[:at]
                req.finish("stop")
                return
        req.output_text = text
        if req.num_output_tokens >= params.max_tokens:
            req.finish("length")

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
        )
        if req.is_finished:
            self._sent.pop(req.request_id, None)
        else:
            self._sent[req.request_id] = (visible, req.num_output_tokens)
        return out


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

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> Request:
        req = Request(request_id or self.new_request_id(), list(prompt_token_ids), sampling)
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        return self.outputs.output(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def close(self) -> None:
        self.executor.close()

    def step(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        if step is None:
            return []
        t0 = time.monotonic()
        for req in step.scheduled:
            if req.scheduled_time is None:
                req.scheduled_time = t0
        tokens = self.executor.execute(step)
        now = time.monotonic()
        live = [r for r in step.requests if not r.is_finished]
        for req, token in zip(step.requests, tokens, strict=True):
            self.outputs.append(req, token, now)
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
    handed to `emit(output)` (the server forwards it to the event loop)."""

    def __init__(self, engine: LLMEngine, emit: Callable[[RequestOutput], None]) -> None:
        self.engine = engine
        self.emit = emit
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

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
                self.engine.add_request(*arg)
            elif kind == "abort":
                out = self.engine.abort(arg)
                if out is not None:
                    self.emit(out)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_work())
                if self.engine.has_work():
                    for out in self.engine.step():
                        self.emit(out)
        except BaseException as e:  # surfaced through /health and the server's exit code
            log.exception("engine loop failed")
            self.error = e
