"""The server state of a decoder model: the engine on its own thread, wired to the event loop.

The engine thread hands every output to the loop, which puts it on its request's queue (`streams`). A sick
engine fails fast: when the engine loop dies, /health turns 503, new requests get 503 at once, in-flight
requests end with an error, and the process exits non-zero (the kubelet restarts it). Metrics and the
perf-metric log are written from the engine's steps and finished requests."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import suppress

from fastapi import Request

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.kv_events import publisher_for
from spyre_runtime.engine.llm_engine import EngineThread, LLMEngine, RequestOutput
from spyre_runtime.entrypoints.formatting import TokenText
from spyre_runtime.entrypoints.images import ImageLimits, ImagePrompter
from spyre_runtime.entrypoints.state import EngineDied, ServingState
from spyre_runtime.entrypoints.submission import Submission
from spyre_runtime.entrypoints.validator import Choice, Limits, Validator
from spyre_runtime.executor.graph_cache import warmup_with_cache
from spyre_runtime.executor.kv_cache import BLOCK_SIZE
from spyre_runtime.executor.model_executor import configure_threads
from spyre_runtime.sampling.guided import GuideCompiler

log = logging.getLogger(__name__)
DEAD_ENGINE_EXIT_DELAY = 5.0  # seconds for in-flight requests to receive their error before exiting


class GenerateState(ServingState):
    def __init__(self, config: RuntimeConfig, api_key: str | None = None) -> None:
        super().__init__(config, api_key)
        self.engine: LLMEngine | None = None
        self.worker: EngineThread | None = None
        self.validator: Validator | None = None
        self.token_text: TokenText | None = None
        self.streams: dict[str, asyncio.Queue] = {}
        self.startup_timings: dict[str, float] = {}
        self.kv_events = publisher_for(config.kv_events)  # before the port is bound: a bad endpoint exits 2
        if self.kv_events is not None and not (config.use_cb and config.enable_prefix_caching):
            log.warning("--kv-events-config: no prefix cache (it needs continuous batching): no events")
        self._prefix_counts = (0, 0)  # the scheduler's prefix-cache queries and hits, as last counted
        self.image_limits = ImageLimits.from_env()  # before the port is bound: a bad value exits 2
        self.images: ImagePrompter | None = None  # an image-text model's processor (images.py)

    # runs on a background thread
    def load(self) -> None:
        t0 = time.monotonic()
        threads = configure_threads(self.config)
        self.engine = LLMEngine(self.config)
        self.startup_timings["load_seconds"] = time.monotonic() - t0
        caching = self.config.use_cb and self.config.enable_prefix_caching
        self.metrics.vllm.cache_config(BLOCK_SIZE, self.engine.executor.kv.num_blocks, caching)
        warm = warmup_with_cache(self.engine.executor, self.config)
        self.startup_timings["warmup_seconds"] = warm.seconds
        self.startup_timings["graphs_compiled"] = warm.num_compiled
        self.metrics.warmup_seconds.set(warm.seconds)
        self.validator = self._validator(self.engine)
        self.token_text = TokenText(self.engine.tokenizer)
        if self.engine.executor.vision is not None:
            self.images = ImagePrompter(self.config.model_dir, self.image_limits, self.engine.executor.vision)
        self.engine.on_step = self._observe_step
        self.worker = EngineThread(self.engine, self._emit, self._engine_died, self._emit_step)
        self.worker.start()
        self.startup_timings["total_seconds"] = time.monotonic() - t0
        self._perf_log("startup", {**self.startup_timings, "threads": threads})

    def _validator(self, engine: LLMEngine) -> Validator:
        cfg = self.config
        max_batch = cfg.max_num_seqs if cfg.use_cb else max(s.batch_size for s in cfg.shapes)
        limits = Limits(cfg.served_model_name, engine.vocab_size, max_batch)
        model_vocab = engine.executor.dims.vocab_size or len(engine.tokenizer)
        guides = GuideCompiler(engine.tokenizer, model_vocab, engine.outputs.eos_ids)
        return Validator(limits, engine.scheduler, guides)

    @property
    def is_healthy(self) -> bool:
        return self.is_ready and self.worker is not None and self.worker.is_alive

    def num_in_flight(self) -> int:
        return len(self.streams)

    def warming(self) -> dict | None:
        return self.engine.executor.progress.snapshot() if self.engine is not None else None

    def stop_engine(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    def close(self) -> None:
        self.stop_engine()
        if self.kv_events is not None:
            self.kv_events.shutdown()
        if self.engine is not None:
            with suppress(Exception):
                self.engine.close(failed=self.engine_error is not None)  # stops the tensor-parallel ranks

    # ---- admitting requests (event loop) ----------------------------------------------------------

    def ready_validator(self) -> Validator:
        """The request checks, once the server is ready (else a 503)."""
        self.require_ready()
        return self.validator

    def submit(self, rid: str, choices: list[Choice], prompts: list[list[int]], images=None) -> Submission:
        sub = Submission(self.streams, self.worker, rid, choices, prompts, images)
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        sub.submit()
        return sub

    # ---- engine thread -> event loop --------------------------------------------------------------

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
        self.engine_error = error
        if self.loop is None:
            self.on_fatal()
            return

        def fail_all() -> None:
            died = EngineDied(error)
            for stream in set(self.streams.values()):
                stream.put_nowait(died)
            self.loop.call_later(DEAD_ENGINE_EXIT_DELAY, self.on_fatal)

        self.loop.call_soon_threadsafe(fail_all)

    # ---- metrics (engine thread) ------------------------------------------------------------------

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


def generate_state(request: Request) -> GenerateState:
    """The app's state (`app.state.serving`), as a route of this task reads it."""
    return request.app.state.serving
