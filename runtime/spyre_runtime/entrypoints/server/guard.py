"""What every route goes through first: who may call (an authorizer from security.py: an API key or a
Kubernetes token) on everything but the open paths, and request bodies of bounded size."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from spyre_runtime.entrypoints.server.auth import Authorizer
from spyre_runtime.entrypoints.server.errors import error_body

MAX_BODY_BYTES = 8 * 1024 * 1024
# reachable without credentials: the kubelet's probes, Prometheus' scrapes and the version (as vLLM's)
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


class Guard:
    """The authorizer and the body-size bound, as a plain ASGI middleware: Starlette's BaseHTTPMiddleware
    (`@app.middleware("http")`) relays every chunk of a streamed response through a task and a memory stream
    of its own, CPU the server shares with the engine's threads on every token. `authorizer` None: open."""

    def __init__(self, app, authorizer: Authorizer | None = None) -> None:
        self.app = app
        self.authorizer = authorizer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            refusal = None
            if self.authorizer is not None and scope["path"] not in OPEN_PATHS:
                refusal = await self.authorizer.refusal(headers)
            if refusal is None:
                refusal = _too_large(headers)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _too_large(headers: Headers) -> JSONResponse | None:
    length = headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        message = f"the request body is larger than {MAX_BODY_BYTES} bytes"
        return JSONResponse(error_body(message, "invalid_request_error"), status_code=413)
    return None
