"""What the server of every task shares: its settings and metrics, its life (booting -> ready -> draining,
or failed), and the checks every route makes before it admits a request. One subclass per engine:
completions/state.GenerateState (decoders), pooling/state.PoolingState (embed, score, rerank)."""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from importlib.metadata import PackageNotFoundError, version

from fastapi import Request
from spyre_contract.tasks import is_pooling_task

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.client import EngineDied
from spyre_runtime.entrypoints.server.errors import APIError
from spyre_runtime.entrypoints.server.metrics import Metrics
from spyre_runtime.entrypoints.server.tracing import tracer_from_env

log = logging.getLogger(__name__)
NOT_READY = "the server is not ready (warming up or shutting down)"
ENGINE_DIED_EXIT_CODE = 1


def runtime_version() -> str:
    try:
        return version("spyre-serve")
    except PackageNotFoundError:
        return "unknown"


class ServingState(ABC):
    """The server's state, shared by its routes (as `app.state.serving`). `boot()` runs on a background
    thread so /health can answer 503 until the model is loaded and warm; a SIGTERM sets `is_draining`
    (new requests get 503) and the server exits once `num_in_flight()` is 0 (launcher.DrainingServer).
    Subclasses load their engine in `load()` and stop it in `stop_engine()` and `close()`."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        generate = not is_pooling_task(config.task)
        speculation = config.ngram_spec_tokens > 0 and not config.max_batch_tkv_limit  # load_config: CB
        self.metrics = Metrics(config.served_model_name, generate, speculation)
        self.tracer = tracer_from_env(config.served_model_name)  # None: off (before the port is bound)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.is_ready = False
        self.is_draining = False
        self.boot_error: BaseException | None = None
        self.on_fatal = lambda: None  # ends the process (set by the launcher)

    # ---- what each engine provides ------------------------------------------------------------------

    @abstractmethod
    def load(self) -> None:
        """Background thread: load the model, warm it up, start the engine thread."""

    @property
    @abstractmethod
    def is_healthy(self) -> bool:
        """Ready, and the engine thread alive."""

    @abstractmethod
    def num_in_flight(self) -> int:
        """Requests admitted and not yet answered: a drain waits for them."""

    def in_flight_report(self) -> str:
        """Where the in-flight requests are, for the log of a drain ("" when the engine does not say)."""
        return ""

    @abstractmethod
    def warming(self) -> dict | None:
        """Graphs (or shapes) compiled and warmed so far, once the model is loading; else None."""

    @abstractmethod
    def observe_load(self) -> None:
        """vLLM's load gauges (requests waiting and running, KV-cache usage), brought up to date before
        /metrics answers."""

    @property
    def engine_error(self) -> BaseException | None:
        """Why the engine loop died, once it has."""
        return None

    def describe(self) -> str:
        """What is served, for the log."""
        return self.config.served_model_name

    def model_card(self) -> dict:
        return {
            "id": self.config.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "spyre-serve",
            "root": str(self.config.model_dir),
            "max_model_len": self.config.max_model_len,
        }

    @abstractmethod
    def stop_engine(self) -> None:
        """The app shuts down: stop the engine thread."""

    def close(self) -> None:
        """The server has stopped: release the engine (and its worker processes)."""
        self.stop_engine()

    # ---- shared ----------------------------------------------------------------------------------

    def boot(self) -> None:
        try:
            self.load()
            self.is_ready = True
            log.info("Ready: serving %s on %s:%d", self.describe(), self.config.host, self.config.port)
        except BaseException as e:
            log.exception("start-up failed")
            self.boot_error = e
            self.on_fatal()

    def require_ready(self) -> None:
        """Every route's first check: 503 while warming up, draining, or after the engine died."""
        if self.engine_error is not None:
            raise APIError(503, EngineDied(self.engine_error).message, code="engine_dead")
        if not self.is_healthy or self.is_draining:
            raise APIError(503, NOT_READY)

    def health(self) -> tuple[int, dict]:
        """/health's status code and body."""
        if self.is_draining:
            return 503, {"status": "draining"}
        if self.boot_error is not None or self.engine_error is not None:
            return 503, {"status": "failed"}
        if not self.is_healthy:
            body: dict = {"status": "warming up"}
            warming = self.warming()
            if warming is not None:  # the operator shows it
                body["warming"] = warming
            return 503, body
        return 200, {"status": "ok"}

    def observe_warming(self) -> None:
        """The warm-up gauges, brought up to date before /metrics answers."""
        warming = self.warming()
        if warming is not None:
            self.metrics.warmup_graphs_done.set(warming["done"])
            self.metrics.warmup_graphs_total.set(warming["total"])

    def exit_code(self) -> int:
        if self.boot_error is not None:
            log.error("start-up failed: %s", self.boot_error)
            return 1
        if self.engine_error is not None:
            log.error("exiting: the engine failed: %s", self.engine_error)
            return ENGINE_DIED_EXIT_CODE
        return 0


def serving_state(request: Request) -> ServingState:
    """The app's state (`app.state.serving`), as a route of this task reads it."""
    return request.app.state.serving
