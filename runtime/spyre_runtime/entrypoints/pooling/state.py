"""The server state of a pooling model (embed, score, rerank): its engine client (engine/pooling_client.py:
the model, its tokenizer, the engine thread that batches the inputs of many requests into the warm-up
shapes) and the admission of requests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from fastapi import Request

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.pooling_client import PoolingClient
from spyre_runtime.entrypoints.server.errors import APIError, model_not_found
from spyre_runtime.entrypoints.server.state import ServingState


class PoolingState(ServingState):
    def __init__(self, config: RuntimeConfig) -> None:
        super().__init__(config)
        self.client = PoolingClient(config, self.metrics)  # before the port is bound: exit 2 with one line
        self.spec = self.client.spec
        self._in_flight = 0

    def load(self) -> None:
        """Background thread: tokenizer, model, warm-up of every shape, engine thread."""
        self.client.load()

    @property
    def tokenizer(self):
        return self.client.tokenizer

    def describe(self) -> str:
        kind = "cross-encoder" if self.spec.is_cross_encoder else "embeddings"
        return f"{self.config.served_model_name} ({kind})"

    @property
    def is_healthy(self) -> bool:
        return self.is_ready and self.client.is_alive

    def num_in_flight(self) -> int:
        return self._in_flight

    def warming(self) -> dict | None:
        return self.client.warming()

    def model_card(self) -> dict:
        card = super().model_card()
        card["max_model_len"] = self.client.max_len
        card["task"] = "score" if self.spec.is_cross_encoder else "embed"
        return card

    def stop_engine(self) -> None:
        self.client.stop()

    def observe_load(self) -> None:
        self.client.observe_load()

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
        try:
            return await self.client.run(rows)
        except Exception as e:
            self.metrics.requests.labels("error").inc()
            raise APIError(500, f"the model failed: {type(e).__name__}: {e}") from None


def pooling_state(request: Request) -> PoolingState:
    """The app's state (`app.state.serving`), as a route of this task reads it."""
    return request.app.state.serving
