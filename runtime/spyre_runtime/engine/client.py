"""The one door from the HTTP layer to a decoder engine: `EngineClient` builds the engine (builder.py),
runs it on its own thread (EngineThread), routes every output to its request's queue on the event loop,
handles a dead engine, and observes the engine's steps and finished requests into the server's metrics.

A sick engine fails fast: when the engine loop dies, every in-flight request's queue gets `EngineDied`, and
`on_fatal()` ends the process a few seconds later (non-zero exit: the kubelet restarts it). `metrics` is
the server's Metrics (its counters, gauges and histograms are read by name here)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from contextlib import suppress

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.builder import KV_BLOCK_SIZE, build_engine
from spyre_runtime.engine.kv_events import publisher_for
from spyre_runtime.engine.llm_engine import EngineThread, LLMEngine, RequestOutput
from spyre_runtime.request import Request
from spyre_runtime.sampling.params import SamplingParams

log = logging.getLogger(__name__)
DEAD_ENGINE_EXIT_DELAY = 5.0  # seconds for in-flight requests to receive their error before exiting


class EngineDied:
    """Put on every in-flight request's queue when the engine loop dies."""

    def __init__(self, error: BaseException) -> None:
        self.message = f"the engine failed ({type(error).__name__}: {error}); the server is restarting"


def describe_in_flight(
    submitted: dict[str, float], requests: dict[str, Request], now: float, limit: int = 8
) -> str:
    """The oldest `limit` in-flight requests as "id (age, where)": waiting or running with its tokens so
    far, finished (its final output is on its way to the HTTP request), or not in the engine (the engine
    thread has not taken it yet: it is in a step, or it lost the request)."""
    parts = []
    for eid, since in sorted(submitted.items(), key=lambda item: item[1])[:limit]:
        req = requests.get(eid)
        where = "not in the engine" if req is None else f"{req.status.value}, {req.num_output_tokens} tokens"
        parts.append(f"{eid} ({now - since:.1f} s, {where})")
    if len(submitted) > limit:
        parts.append(f"{len(submitted) - limit} more")
    return "; ".join(parts)


class EngineClient:
    def __init__(self, config: RuntimeConfig, metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.engine: LLMEngine | None = None
        self.worker: EngineThread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.streams: dict[str, asyncio.Queue] = {}  # engine request id -> its HTTP request's queue
        self._submitted: dict[str, float] = {}  # engine request id -> when it was submitted (monotonic)
        self.error: BaseException | None = None  # why the engine loop died
        self.on_fatal: Callable[[], None] = lambda: None  # ends the process (set by the server)
        self.startup_timings: dict[str, float] = {}
        self._threads = 0
        self._t0 = 0.0
        self.kv_events = publisher_for(config.kv_events)  # before the port is bound: a bad endpoint exits 2
        if self.kv_events is not None and not (config.use_cb and config.enable_prefix_caching):
            log.warning("--kv-events-config: no prefix cache (it needs continuous batching): no events")
        self._prefix_counts = (0, 0)  # the scheduler's prefix-cache queries and hits, as last counted
        self._draft_counts = (0, 0)  # n-gram drafts proposed and kept, as last counted

    # ---- start-up (a background thread) -------------------------------------------------------------

    def load(self) -> LLMEngine:
        """Threads -> engine -> warm-up; the engine thread is not started yet (start())."""
        self._t0 = time.monotonic()
        caching = self.config.use_cb and self.config.enable_prefix_caching

        def loaded(engine: LLMEngine) -> None:
            self.metrics.vllm.cache_config(KV_BLOCK_SIZE, engine.executor.kv.num_blocks, caching)
            self.engine = engine  # /health shows the warm-up's progress from here

        built = build_engine(self.config, on_loaded=loaded)
        self._threads = built.threads
        self.startup_timings["load_seconds"] = built.load_seconds
        self.startup_timings["warmup_seconds"] = built.warmup.seconds
        self.startup_timings["graphs_compiled"] = built.warmup.num_compiled
        self.metrics.warmup_seconds.set(built.warmup.seconds)
        return built.engine

    def start(self) -> None:
        """Starts the engine thread; the start-up's timings go to the perf-metric log."""
        self.engine.on_step = self._observe_step
        self.worker = EngineThread(self.engine, self._emit, self._engine_died, self._emit_step)
        self.worker.start()
        self.startup_timings["total_seconds"] = time.monotonic() - self._t0
        self._perf_log("startup", {**self.startup_timings, "threads": self._threads})

    # ---- what the HTTP layer reads --------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def eos_ids(self) -> set[int]:
        return self.engine.outputs.eos_ids

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold."""
        return self.engine.vocab_size

    @property
    def scheduler(self):
        """The scheduler's limits (`can_admit`, `max_tokens_for`, `describe_limits`), read by the checks."""
        return self.engine.scheduler

    @property
    def vision(self):
        """An image-text model's vision tower, else None."""
        return self.engine.executor.vision

    @property
    def model_vocab_size(self) -> int:
        """Token ids the model embeds (its tokenizer's size when the model does not say)."""
        return self.engine.executor.dims.vocab_size or len(self.engine.tokenizer)

    @property
    def is_alive(self) -> bool:
        return self.worker is not None and self.worker.is_alive

    def warming(self) -> dict | None:
        return self.engine.executor.progress.snapshot() if self.engine is not None else None

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    def close(self) -> None:
        self.stop()
        if self.kv_events is not None:
            self.kv_events.shutdown()
        if self.engine is not None:
            with suppress(Exception):
                self.engine.close(failed=self.error is not None)  # stops the tensor-parallel ranks

    # ---- requests (event loop) ------------------------------------------------------------------------

    def submit(
        self, queue: asyncio.Queue, prompt: list[int], params: SamplingParams, eid: str, images=None
    ) -> None:
        """Engine request `eid`; its outputs go to `queue`."""
        self.streams[eid] = queue
        self._submitted[eid] = time.monotonic()
        self.worker.submit(prompt, params, eid, images)

    def forget(self, eid: str) -> None:
        self.streams.pop(eid, None)
        self._submitted.pop(eid, None)

    def in_flight_report(self) -> str:
        """Where each in-flight request is, for a drain's log (the engine's table is read, not changed)."""
        requests = self.engine.requests if self.engine is not None else {}
        return describe_in_flight(dict(self._submitted), requests, time.monotonic())

    def abort(self, eid: str) -> None:
        self.worker.abort(eid)

    # ---- engine thread -> event loop ------------------------------------------------------------------

    def _emit(self, out: RequestOutput) -> None:
        self._observe_tokens(out)
        if out.finished:
            self._observe_finished(out)
            self._observe_queue()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._dispatch, out)

    def _emit_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, handed to the event loop in one wake-up (not one per request: each wake-up
        costs the loop a self-pipe write and a selector round that take CPU from the GEMM threads).
        Measured at 8 streams, with the plain ASGI guard (guard.Guard): 161 -> 175 output tok/s. Making
        the engine wait until the loop had written the step's chunks (so the writes would not overlap the
        next step's GEMMs) measured 165-172: it does not."""
        if not outputs:
            return
        for out in outputs:
            self._observe_tokens(out)
            if out.finished:
                self._observe_finished(out)
        if any(out.finished for out in outputs):
            self._observe_queue()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._dispatch_step, outputs)

    def _dispatch_step(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._dispatch(out)

    def _dispatch(self, out: RequestOutput) -> None:
        stream = self.streams.get(out.request_id)
        if stream is not None:
            stream.put_nowait(out)

    def _engine_died(self, error: BaseException) -> None:
        """Engine thread: fail every in-flight request, then end the process (non-zero exit)."""
        self.error = error
        if self.loop is None:
            self.on_fatal()
            return

        def fail_all() -> None:
            died = EngineDied(error)
            for stream in set(self.streams.values()):
                stream.put_nowait(died)
            self.loop.call_later(DEAD_ENGINE_EXIT_DELAY, self.on_fatal)

        self.loop.call_soon_threadsafe(fail_all)

    # ---- metrics (engine thread) ----------------------------------------------------------------------

    def _observe_step(self, step, seconds: float) -> None:
        m = self.metrics
        kind = "prefill" if step.is_prefill else "decode"
        m.step_seconds.labels("mixed" if getattr(step, "mixed", False) else kind).observe(seconds)
        m.batch_occupancy.set(step.occupancy)
        self._observe_queue()
        sched = self.engine.scheduler
        queries, hits = sched.num_prefix_queries, sched.num_prefix_hits
        m.vllm.prefix_cache_queries.inc(queries - self._prefix_counts[0])
        m.vllm.prefix_cache_hits.inc(hits - self._prefix_counts[1])
        self._prefix_counts = (queries, hits)
        if m.vllm.spec_draft_tokens is not None:
            drafts, kept = sched.num_draft_tokens, self.engine.num_accepted_tokens
            m.vllm.spec_draft_tokens.inc(drafts - self._draft_counts[0])
            m.vllm.spec_accepted_tokens.inc(kept - self._draft_counts[1])
            self._draft_counts = (drafts, kept)
        m.sendnn.observe(sched, step)
        if self.kv_events is not None:
            self.kv_events.publish(sched.take_kv_events())

    def _observe_queue(self) -> None:
        """Called on the engine thread, after a step or an abort."""
        sched = self.engine.scheduler
        self.metrics.queue_length.set(sched.num_waiting)
        self.metrics.running.set(sched.num_running)
        self.observe_load()

    def observe_load(self) -> None:
        """The engine thread after a step, and the event loop before /metrics answers (the scheduler's
        counts are read, never changed)."""
        if self.engine is None:
            return
        sched, v = self.engine.scheduler, self.metrics.vllm
        v.num_requests_waiting.set(sched.num_waiting)
        v.num_requests_running.set(sched.num_running)
        v.kv_cache_usage.set(sched.kv_cache_usage)

    def _observe_tokens(self, out: RequestOutput) -> None:
        """vLLM's token counters: generated tokens as they come, the prompt with the first of them."""
        new = len(out.delta_token_ids)
        self.metrics.vllm.generation_tokens.inc(new)
        if new and new == len(out.token_ids):
            self.metrics.vllm.prompt_tokens.inc(out.num_prompt_tokens)

    def _observe_finished(self, out: RequestOutput) -> None:
        m = self.metrics
        m.requests.labels(out.finish_reason or "unknown").inc()
        m.generated_tokens.inc(len(out.token_ids))
        m.vllm.finished(out.finish_reason)
        t = out.timings
        if t is None:
            return
        if t.ttft_seconds is not None:
            m.ttft.observe(t.ttft_seconds)
            m.vllm.ttft.observe(t.ttft_seconds)
        for gap in t.itl_seconds:
            m.itl.observe(gap)
            m.vllm.itl.observe(gap)
        m.vllm.e2e.observe(t.finished - t.arrival)
        if t.queue_seconds is not None:
            m.vllm.queue_time.observe(t.queue_seconds)
        self._perf_log(
            "request",
            {
                "request_id": out.request_id,
                "queue_seconds": t.queue_seconds,
                "ttft_seconds": t.ttft_seconds,
                "itl_seconds": t.itl_seconds,
                "prompt_tokens": out.num_prompt_tokens,
                "generated_tokens": len(out.token_ids),
                "finish_reason": out.finish_reason,
                "e2e_seconds": t.finished - t.arrival,
            },
        )

    def _perf_log(self, kind: str, record: dict) -> None:
        if not self.config.perf_metric_logging_enabled:
            return
        path = self.config.perf_metric_logging_dir / f"spyre_perf_{kind}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps({"time": time.time(), **record}) + "\n")
