"""The one door from the HTTP layer to a pooling engine (embed, score, rerank): `PoolingClient` reads what
the model is (before the port is bound), builds it (builder.py), runs the engine thread that batches the
inputs of many requests into the warm-up shapes, hands each input's output back to the event loop, and
observes the steps into the server's metrics (`metrics`: the server's Metrics, read by name)."""

from __future__ import annotations

import asyncio
import time

import torch

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.builder import build_pooling, describe_shapes, pooling_spec
from spyre_runtime.engine.pooling import PoolingEngine
from spyre_runtime.engine.sched.pooling import PoolingScheduler, PoolItem


class PoolingClient:
    def __init__(self, config: RuntimeConfig, metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.spec = pooling_spec(config)  # a ConfigError (one line, exit 2) before the port is bound
        self.scheduler = PoolingScheduler(config.shapes)
        self.tokenizer = None
        self.model = None
        self.engine: PoolingEngine | None = None
        self._rows_in_flight = 0  # inputs submitted to the engine and not answered (event loop only)

    def load(self) -> None:
        """Background thread: tokenizer, model, warm-up of every shape, engine thread."""
        built = build_pooling(self.config, self.spec)
        self.tokenizer, self.model = built.tokenizer, built.model
        self.metrics.warmup_seconds.set(built.warmup.seconds)
        self.engine = PoolingEngine(self.model, self.scheduler)
        self.engine.on_step = self._observe_step
        self.engine.start()

    @property
    def is_alive(self) -> bool:
        return self.engine is not None and self.engine.is_alive

    @property
    def max_len(self) -> int:
        """The longest warm-up prompt length."""
        return self.scheduler.max_len

    def describe_shapes(self) -> str:
        return describe_shapes(self.config)

    def warming(self) -> dict | None:
        return self.model.progress.snapshot() if self.model is not None else None

    def stop(self) -> None:
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

    async def run(self, rows: list[tuple[list[int], list[int] | None]]) -> list[torch.Tensor]:
        """Submits every row to the engine and waits for all of them (batched with other requests); a
        failed row raises its error."""
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


def _settle(future: asyncio.Future, out) -> None:
    if future.done():
        return
    if isinstance(out, BaseException):
        future.set_exception(out)
    else:
        future.set_result(out)
