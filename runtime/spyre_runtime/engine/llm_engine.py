"""The engine: one step is schedule -> execute -> update, with the tokenizer-side output processing
(outputs.py) after it. It is driven either synchronously (`LLM`, llm.py) or from a thread (`EngineThread`,
which the server's client.EngineClient owns, so requests are accepted while a batch computes)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.outputs import OutputProcessor, RequestOutput, eos_token_ids, load_tokenizer
from spyre_runtime.engine.sched.admission import check_admissible
from spyre_runtime.engine.sched.factory import make_scheduler
from spyre_runtime.engine.sched.speculation import accepted
from spyre_runtime.executor.model_executor import ModelExecutor
from spyre_runtime.request import ImageInput, Request
from spyre_runtime.sampling.params import SamplingParams, TokenLogprob
from spyre_runtime.sampling.sampler import token_logprobs

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: RuntimeConfig, executor: ModelExecutor | None = None, tokenizer=None) -> None:
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_dir)
        self.executor = executor if executor is not None else ModelExecutor(config)
        self.scheduler = make_scheduler(config)  # sched/: static or continuous batching
        if getattr(self.executor, "mamba", None) is not None:  # Mamba state cannot step back (speculation.py)
            self.scheduler.spec_tokens = 0
        self.outputs = OutputProcessor(self.tokenizer, eos_token_ids(config.model_dir, self.tokenizer))
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.on_step: Callable[[object, float], None] | None = None  # (step, seconds) hook for metrics
        self.num_accepted_tokens = 0  # n-gram drafts the requests kept

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: those the model embeds and the tokenizer can decode."""
        model_vocab = self.executor.dims.vocab_size or len(self.tokenizer)
        return min(model_vocab, len(self.tokenizer))

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        images: ImageInput | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Raises ValueError (nothing is queued) when the request can never run. `images`: an image-text
        model's images (entrypoints/chat/images.py). `arrival_time`: when it was submitted (monotonic; now
        by default)."""
        sampling = dataclasses.replace(sampling, eos_token_ids=tuple(sorted(self.outputs.eos_ids)))
        req = Request(request_id or self.new_request_id(), list(prompt_token_ids), sampling, images=images)
        if arrival_time is not None:
            req.arrival_time = arrival_time
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
        live = list(dict.fromkeys(r for r in step.requests if not r.is_finished))  # a request's drafts: rows
        rows = getattr(step, "decode", ())
        for i in accepted(step.requests, rows, sampled.token_ids):
            req = step.requests[i]
            if i < len(rows) and rows[i].draft and not req.is_finished:
                self.num_accepted_tokens += 1  # n-gram drafts kept (engine/sched/speculation.py)
            try:
                self.outputs.append(req, sampled.token_ids[i], sampled.logprobs[i], now)
            except Exception as e:
                self.fail(req, e)
        outputs = [self.outputs.output(r) for r in live]
        for req in self.scheduler.update(step):
            self.requests.pop(req.request_id, None)
        if self.on_step is not None:
            self.on_step(step, now - t0)
        return outputs


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

    def submit(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str, images=None
    ) -> None:
        # submitted now: the request arrived while the engine ran its step (a wave's start counts on it)
        self._commands.put(("add", (prompt_token_ids, sampling, request_id, images, time.monotonic())))

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

    def _add(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str, images, arrival: float
    ) -> None:
        try:
            self.engine.add_request(prompt_token_ids, sampling, request_id, images, arrival_time=arrival)
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
