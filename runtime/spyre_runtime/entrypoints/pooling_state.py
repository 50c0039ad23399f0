"""The server state of a pooling model (embed, score, rerank): the model, its tokenizer, and the engine
thread that batches the inputs of many requests into the warm-up shapes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from fastapi import Request

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.pooling import PoolingEngine
from spyre_runtime.engine.sched.pooling import PoolingScheduler, PoolItem
from spyre_runtime.entrypoints.errors import APIError, model_not_found
from spyre_runtime.entrypoints.state import ServingState
from spyre_runtime.executor.families.pooling import PoolingModel, PoolingSpec, check_shapes, detect_pooling
from spyre_runtime.executor.graph_cache import warmup_with_cache
from spyre_runtime.executor.model_executor import configure_threads


class PoolingState(ServingState):
    def __init__(self, config: RuntimeConfig, api_key: str | None = None) -> None:
        super().__init__(config, api_key)
        self.spec: PoolingSpec = detect_pooling(config.model_dir, config.task)
        check_shapes(config, self.spec)  # before the port is bound: exit 2 with one line
        self.tokenizer = None
        self.model: PoolingModel | None = None
        self.scheduler = PoolingScheduler(config.shapes)
        self.engine: PoolingEngine | None = None
        self._in_flight = 0
        self._rows_in_flight = 0  # inputs submitted to the engine and not answered (event loop only)

    def load(self) -> None:
        """Background thread: tokenizer, model, warm-up of every shape, engine thread."""
        from transformers import AutoTokenizer

        configure_threads(self.config)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model_dir)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.model = PoolingModel(self.config, self.spec, pad_id)
        warm = warmup_with_cache(self.model, self.config)  # the graph cache, when enabled
        self.metrics.warmup_seconds.set(warm.seconds)
        self.engine = PoolingEngine(self.model, self.scheduler)
        self.engine.on_step = self._observe_step
        self.engine.start()

    def describe(self) -> str:
        kind = "cross-encoder" if self.spec.is_cross_encoder else "embeddings"
        return f"{self.config.served_model_name} ({kind})"

    @property
    def is_healthy(self) -> bool:
        return self.is_ready and self.engine is not None and self.engine.is_alive

    def num_in_flight(self) -> int:
        return self._in_flight

    def warming(self) -> dict | None:
        return self.model.progress.snapshot() if self.model is not None else None

    def model_card(self) -> dict:
        card = super().model_card()
        card["max_model_len"] = self.scheduler.max_len
        card["task"] = "score" if self.spec.is_cross_encoder else "embed"
        return card

    def stop_engine(self) -> None:
        if self.engine is not None:
            self.engine.stop()

    def _observe_step(self, step, seconds: float) -> None:
        self.metrics.step_seconds.labels("pool").observe(seconds)
        self.metrics.batch_occupancy.set(step.occupancy)
        self.metrics.queue_length.set(self.scheduler.num_waiting)

    def observe_load(self) -> None:
        """vLLM's gauges, counting each input as a request (as vLLM does): waiting in the scheduler, or in
        a step (submitted, not answered, not waiting)."""
        waiting = self.scheduler.num_waiting
        self.metrics.vllm.num_requests_waiting.set(waiting)
        self.metrics.vllm.num_requests_running.set(max(0, self._rows_in_flight - waiting))

    def _settle_row(self, future: asyncio.Future, item: PoolItem, out) -> None:
        """Event loop: one input answered (a late answer to a cancelled request is dropped)."""
        if future.done():
            return
        self._rows_in_flight -= 1
        v = self.metrics.vllm
        if isinstance(out, BaseException):
            v.finished("error")
        else:
            v.finished("stop")
            v.prompt_tokens.inc(len(item.token_ids))
            v.e2e.observe(time.monotonic() - item.arrival)
        _settle(future, out)

    # ---- requests (event loop) --------------------------------------------------------------------

    @contextmanager
    def admitted(self, model: str | None) -> Iterator[None]:
        """A request for `model` while the server is ready (else 503, or 404 for another model), counted in
        flight until the block ends: a SIGTERM drain waits for it."""
        self.require_ready()
        if model is not None and model != self.config.served_model_name:
            raise model_not_found(model, self.config.served_model_name)
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1

    async def run(self, rows: list[tuple[list[int], list[int] | None]]) -> list[torch.Tensor]:
        """Submits every row to the engine and waits for all of them (batched with other requests)."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in rows]

        def deliver_to(i: int):
            def deliver(out) -> None:
                loop.call_soon_threadsafe(self._settle_row, futures[i], items[i], out)

            return deliver

        items = [PoolItem(ids, types, deliver_to(i)) for i, (ids, types) in enumerate(rows)]
        self._rows_in_flight += len(items)
        self.engine.submit(items)
        self.metrics.queue_length.set(self.scheduler.num_waiting)
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            for item in items:
                item.is_cancelled = True
            unanswered = sum(f.cancelled() for f in futures)
            self._rows_in_flight -= unanswered
            self.metrics.vllm.request_success["abort"].inc(unanswered)
            raise
        except Exception as e:
            self.metrics.requests.labels("error").inc()
            raise APIError(500, f"the model failed: {type(e).__name__}: {e}") from None


def _settle(future: asyncio.Future, out) -> None:
    if future.done():
        return
    if isinstance(out, BaseException):
        future.set_exception(out)
    else:
        future.set_result(out)


def pooling_state(request: Request) -> PoolingState:
    """The app's state (`app.state.serving`), as a route of this task reads it."""
    return request.app.state.serving
