"""Running the app under uvicorn, with the same life for every task: SIGTERM drains (stop admitting with
503, finish what is in flight within the grace period, exit 0), and a failed start-up or a dead engine ends
the process (non-zero exit: the kubelet restarts it)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn
from fastapi import FastAPI

from spyre_runtime.entrypoints.server.state import ServingState

log = logging.getLogger(__name__)
DRAIN_POLL_SECONDS = 0.05
# How long an idle keep-alive connection stays open: longer than the clients' own idle limit, so that the
# server never closes a connection a client is reusing at that moment. uvicorn's default (5 s) equals httpx's,
# and so the official openai client's: measured, 3 of 400 requests failed with "Server disconnected without
# sending a response" after 4.85-5.14 s idle. 65 s also outlasts nginx's and a cloud load balancer's 60 s.
# A drain closes idle connections at once whatever this is.
KEEP_ALIVE_SECONDS = 65


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM turned into a drain: stop admitting (503), finish in-flight requests within
    the grace period, then exit 0."""

    def __init__(self, config: uvicorn.Config, state: ServingState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM or not self.state.config.override_signals_handler or self.state.is_draining:
            return super().handle_exit(sig, frame)
        log.info("SIGTERM: draining %d in-flight requests%s", self.state.num_in_flight(), self._where())
        self.state.is_draining = True
        loop = self.state.loop
        if loop is not None:
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))
        else:
            super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.state.config.shutdown_grace_seconds
        while self.state.num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        if left := self.state.num_in_flight():
            log.warning("grace period over with %d requests in flight%s", left, self._where())
        self.should_exit = True

    def _where(self) -> str:
        report = self.state.in_flight_report()
        return f": {report}" if report else ""


def serve_http(app: FastAPI, state: ServingState, tls: dict | None = None) -> None:
    """Serves `app` until SIGTERM (drained), SIGINT, or a fatal error; then releases the engine. `tls`:
    uvicorn's ssl_* arguments (security.Security.uvicorn_ssl, checked at start-up): HTTPS only."""
    config = state.config
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        **(tls or {}),
    )
    server = DrainingServer(uv_config, state)

    def fatal() -> None:
        server.should_exit = True

    state.on_fatal = fatal
    try:
        server.run()
    finally:
        state.close()
        if state.tracer is not None:
            state.tracer.shutdown()  # the spans the batch processor still holds
