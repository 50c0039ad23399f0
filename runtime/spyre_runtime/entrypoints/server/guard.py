"""What every route goes through first: the API key (Bearer) on everything but /health and /metrics, and
request bodies of bounded size."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from spyre_runtime.entrypoints.server.errors import error_body

MAX_BODY_BYTES = 8 * 1024 * 1024
OPEN_PATHS = frozenset({"/health", "/metrics"})  # reachable without the API key


class Guard:
    """The API key and the body-size bound, as a plain ASGI middleware: Starlette's BaseHTTPMiddleware
    (`@app.middleware("http")`) relays every chunk of a streamed response through a task and a memory stream
    of its own, CPU the server shares with the engine's threads on every token. `api_key()` gives the key
    (None or empty: open)."""

    def __init__(self, app, api_key: Callable[[], str | None]) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> JSONResponse | None:
        headers = Headers(scope=scope)
        key = self.api_key()
        if key and scope["path"] not in OPEN_PATHS:
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
                body = error_body(
                    "invalid or missing API key", "authentication_error", code="invalid_api_key"
                )
                return JSONResponse(body, status_code=401)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            message = f"the request body is larger than {MAX_BODY_BYTES} bytes"
            return JSONResponse(error_body(message, "invalid_request_error"), status_code=413)
        return None
