"""The OpenAI-compatible HTTP server (FastAPI + uvicorn), one for every task: the model's task picks the
engine that boots (GenerateState or PoolingState) and the routers that mount; the lifespan, the guard (an
API key or Kubernetes tokens, server/security.py), TLS, the error bodies, /health, /metrics, /v1/models and
the SIGTERM drain (server/) are the same for all. One folder per API, each with its router, protocol and
serving module:

    generate:           completions/ (/v1/completions, /v1/chat/completions)
                        responses/ (/v1/responses)
                        tokenization/ (/tokenize, /detokenize)
    embed/score/rerank: pooling/ (/v1/embeddings, /score, /rerank)
    every task:         admin/ (/health, /metrics, /version, /v1/models)

chat/ holds what reading and writing a chat takes (prompts, images, tools, tool and reasoning parsers).
The engine runs on its own thread behind its client (engine/client.py); model loading and warm-up run in
the background so /health can answer 503 until they are done."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI
from spyre_contract.tasks import is_pooling_task

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.entrypoints.admin.router import router as admin_router
from spyre_runtime.entrypoints.chat.tools import ChatSettings
from spyre_runtime.entrypoints.completions.protocol import UNSUPPORTED
from spyre_runtime.entrypoints.completions.router import router as completions_router
from spyre_runtime.entrypoints.completions.state import GenerateState
from spyre_runtime.entrypoints.pooling.router import router as pooling_router
from spyre_runtime.entrypoints.pooling.state import PoolingState
from spyre_runtime.entrypoints.responses.protocol import RESPONSES_UNSUPPORTED
from spyre_runtime.entrypoints.responses.router import router as responses_router
from spyre_runtime.entrypoints.responses.serving import ResponseStore
from spyre_runtime.entrypoints.server.auth import Authorizer
from spyre_runtime.entrypoints.server.errors import install_error_handlers
from spyre_runtime.entrypoints.server.guard import OPEN_PATHS, Guard
from spyre_runtime.entrypoints.server.launcher import serve_http
from spyre_runtime.entrypoints.server.security import Security
from spyre_runtime.entrypoints.server.state import ServingState
from spyre_runtime.entrypoints.tokenization.router import router as tokenization_router

log = logging.getLogger(__name__)


def build_state(config: RuntimeConfig) -> ServingState:
    """The state of the engine the model's task needs (a pooling model's is checked here, before the port
    is bound: a ConfigError is one line and exit 2)."""
    if is_pooling_task(config.task):
        return PoolingState(config)
    return GenerateState(config)


def build_app(
    state: ServingState, chat: ChatSettings | None = None, authorizer: Authorizer | None = None
) -> FastAPI:
    """`chat`: how chat output is read (tool calls, reasoning); decoders only. `authorizer`: who may call
    (server/security.py; None: anyone)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        threading.Thread(target=state.boot, name="boot", daemon=True).start()
        yield
        state.stop_engine()

    pooling = isinstance(state, PoolingState)
    app = FastAPI(
        title="spyre-serve pooling runtime" if pooling else "spyre-serve runtime", lifespan=lifespan
    )
    app.state.serving = state
    app.state.chat = chat or ChatSettings()
    app.add_middleware(Guard, authorizer=authorizer)
    app.include_router(admin_router)
    if pooling:
        app.include_router(pooling_router)
        install_error_handlers(app, unsupported={})
    else:
        app.include_router(completions_router)
        app.include_router(responses_router)
        app.include_router(tokenization_router)
        app.state.responses = ResponseStore()
        install_error_handlers(app, unsupported={**RESPONSES_UNSUPPORTED, **UNSUPPORTED})
    return app


def serve(config: RuntimeConfig, chat: ChatSettings | None = None, security: Security | None = None) -> int:
    """Serves the model until SIGTERM (drained: exit 0) or a failure (exit 1)."""
    security = security or Security()
    authorizer = security.authorizer(os.environ)  # before the engine is built: a ConfigError is one line
    state = build_state(config)
    if authorizer is not None:
        log.info("Callers need %s on all but %s", authorizer.describe(), ", ".join(sorted(OPEN_PATHS)))
    serve_http(build_app(state, chat, authorizer), state, security.uvicorn_ssl())
    return state.exit_code()
