"""The OpenAI-compatible HTTP server (FastAPI + uvicorn). The engine runs on its own thread; this module
only validates, admits, streams and reports. Model loading and warmup run in the background so /health can
answer 503 until they are done."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine import EngineThread, LLMEngine, RequestOutput
from spyre_runtime.executor import configure_threads
from spyre_runtime.graph_cache import warmup_with_cache
from spyre_runtime.metrics import Metrics
from spyre_runtime.sampling import SamplingParams

log = logging.getLogger(__name__)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


# ---- request schemas -----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ---- server state --------------------------------------------------------------------------------


class ServerState:
    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.engine: LLMEngine | None = None
        self.worker: EngineThread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.streams: dict[str, asyncio.Queue] = {}
        self.is_ready = False
        self.is_draining = False
        self.boot_error: BaseException | None = None
        self.startup_timings: dict[str, float] = {}
        self.on_fatal = lambda: None

    # runs on a background thread
    def boot(self) -> None:
        try:
            t0 = time.monotonic()
            threads = configure_threads(self.config)
            self.engine = LLMEngine(self.config)
            self.startup_timings["load_seconds"] = time.monotonic() - t0
            warm = warmup_with_cache(self.engine.executor, self.config)
            self.startup_timings["warmup_seconds"] = warm.seconds
            self.startup_timings["graphs_compiled"] = warm.num_compiled
            self.metrics.warmup_seconds.set(warm.seconds)
            self.engine.on_step = self._observe_step
            self.worker = EngineThread(self.engine, self._emit)
            self.worker.start()
            self.startup_timings["total_seconds"] = time.monotonic() - t0
            self._perf_log("startup", {**self.startup_timings, "threads": threads})
            self.is_ready = True
            log.info(
                "Ready: serving %s on %s:%d",
                self.config.served_model_name,
                self.config.host,
                self.config.port,
            )
        except BaseException as e:
            log.exception("start-up failed")
            self.boot_error = e
            self.on_fatal()

    @property
    def is_healthy(self) -> bool:
        return (
            self.is_ready
            and self.worker is not None
            and self.worker.error is None
            and self.worker.thread.is_alive()
        )

    def num_in_flight(self) -> int:
        return len(self.streams)

    # engine thread -> event loop
    def _emit(self, out: RequestOutput) -> None:
        if out.finished:
            self._observe_finished(out)
            self._observe_queue()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._dispatch, out)

    def _dispatch(self, out: RequestOutput) -> None:
        stream = self.streams.get(out.request_id)
        if stream is not None:
            stream.put_nowait(out)

    def _observe_step(self, step, seconds: float) -> None:
        m = self.metrics
        m.step_seconds.labels("prefill" if step.is_prefill else "decode").observe(seconds)
        m.batch_occupancy.set(step.occupancy)
        self._observe_queue()

    def _observe_queue(self) -> None:
        """Called on the engine thread, after a step or an abort."""
        sched = self.engine.scheduler
        self.metrics.queue_length.set(sched.num_waiting)
        self.metrics.running.set(sched.num_running)

    def _observe_finished(self, out: RequestOutput) -> None:
        m = self.metrics
        m.requests.labels(out.finish_reason or "unknown").inc()
        m.generated_tokens.inc(len(out.token_ids))
        t = out.timings
        if t is None:
            return
        if t.ttft_seconds is not None:
            m.ttft.observe(t.ttft_seconds)
        for gap in t.itl_seconds:
            m.itl.observe(gap)
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


# ---- the app -------------------------------------------------------------------------------------


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        threading.Thread(target=state.boot, name="boot", daemon=True).start()
        yield
        if state.worker is not None:
            state.worker.stop()

    app = FastAPI(title="spyre-serve runtime", lifespan=lifespan)
    config = state.config

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        kind = "invalid_request_error" if e.status < 500 else "service_unavailable"
        return JSONResponse(error_body(e.message, kind, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            param = None
            message = f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}"
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.get("/health")
    async def health():
        if state.is_draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if state.boot_error is not None or (state.worker is not None and state.worker.error is not None):
            return JSONResponse({"status": "failed"}, status_code=503)
        if not state.is_healthy:
            return JSONResponse({"status": "warming up"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": config.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "spyre-serve",
                    "max_model_len": config.max_model_len,
                }
            ],
        }

    def require_ready() -> None:
        if not state.is_ready or state.is_draining:
            raise APIError(503, "the server is not ready (warming up or shutting down)")

    def admit(body: _SamplingFields, prompt_ids: list[int], default_max: int | None) -> SamplingParams:
        """Checks the model name, the prompt and the shapes; the caller already checked readiness."""
        if body.model != config.served_model_name:
            raise APIError(
                404,
                f"model {body.model!r} does not exist; this server serves {config.served_model_name!r}",
                "model",
                "model_not_found",
            )
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", "prompt")
        n = len(prompt_ids)
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        scheduler = state.engine.scheduler
        room = scheduler.max_tokens_for(n)
        if max_tokens is None:
            max_tokens = max(1, min(default_max or room, room))
        if not scheduler.can_admit(n, max_tokens):
            raise APIError(
                400,
                f"the request ({n} prompt tokens, max_tokens={max_tokens}) {scheduler.describe_limits()}",
                "max_tokens" if room > 0 else "prompt",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_k=body.top_k,
                top_p=body.top_p,
                seed=body.seed,
                stop=body.stop or (),
                stop_token_ids=body.stop_token_ids or (),
                ignore_eos=body.ignore_eos,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def tokenize(text: str) -> list[int]:
        return state.engine.tokenizer(text, add_special_tokens=False)["input_ids"]

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        require_ready()
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        ids = tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        params = admit(body, ids, COMPLETIONS_DEFAULT_MAX_TOKENS)
        return await respond(request, body, ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        require_ready()
        messages = [{"role": m.role, "content": _text_of(m.content)} for m in body.messages]
        try:
            ids = state.engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
        except Exception as e:
            raise APIError(
                400, f"messages could not be rendered with the chat template: {e}", "messages"
            ) from None
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        params = admit(body, list(ids), None)
        return await respond(request, body, list(ids), params, chat=True)

    async def respond(
        request: Request, body: _SamplingFields, ids: list[int], params: SamplingParams, chat: bool
    ):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        stream: asyncio.Queue = asyncio.Queue()
        state.streams[rid] = stream
        state.metrics.prompt_tokens.inc(len(ids))
        state.worker.submit(ids, params, rid)
        created = int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return StreamingResponse(
                sse(rid, stream, created, chat, include_usage), media_type="text/event-stream"
            )
        try:
            while True:
                out: RequestOutput = await stream.get()
                if out.finished:
                    break
        except asyncio.CancelledError:
            state.worker.abort(rid)
            raise
        finally:
            state.streams.pop(rid, None)
        usage = _usage(out)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": out.text},
                "finish_reason": out.finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
            obj = "text_completion"
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": config.served_model_name,
            "choices": [choice],
            "usage": usage,
        }

    async def sse(
        rid: str, stream: asyncio.Queue, created: int, chat: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        finished = False

        def chunk(choice: dict, usage: dict | None = None) -> str:
            payload = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": config.served_model_name,
                "choices": [choice] if choice else [],
            }
            if usage is not None:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        try:
            if chat:
                yield chunk(
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                )
            while not finished:
                out: RequestOutput = await stream.get()
                finished = out.finished
                reason = out.finish_reason if finished else None
                if out.delta_text or finished:
                    if chat:
                        delta = {"content": out.delta_text} if out.delta_text else {}
                        yield chunk({"index": 0, "delta": delta, "finish_reason": reason})
                    else:
                        yield chunk(
                            {"index": 0, "text": out.delta_text, "logprobs": None, "finish_reason": reason}
                        )
            if include_usage:
                yield chunk({}, _usage(out))
            yield "data: [DONE]\n\n"
        finally:
            state.streams.pop(rid, None)
            if not finished:  # the client went away: free its slot
                state.worker.abort(rid)

    return app


def _text_of(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def _usage(out: RequestOutput) -> dict:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": len(out.token_ids),
        "total_tokens": out.num_prompt_tokens + len(out.token_ids),
    }


# ---- running it ----------------------------------------------------------------------------------


class Server(uvicorn.Server):
    """uvicorn, with SIGTERM turned into a drain: stop admitting (503), finish in-flight requests within
    the grace period, then exit 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._draining_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM or not self.state.config.override_signals_handler or self.state.is_draining:
            return super().handle_exit(sig, frame)
        log.info("SIGTERM: draining %d in-flight requests", self.state.num_in_flight())
        self.state.is_draining = True
        loop = self.state.loop
        if loop is not None:
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))
        else:
            super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.state.config.shutdown_grace_seconds
        while self.state.num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.num_in_flight():
            log.warning("grace period over with %d requests in flight", self.state.num_in_flight())
        self.should_exit = True


def serve(config: RuntimeConfig) -> int:
    state = ServerState(config)
    app = create_app(state)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = Server(uv_config, state)

    def fatal() -> None:
        server.should_exit = True

    state.on_fatal = fatal
    try:
        server.run()
    finally:
        if state.worker is not None:
            state.worker.stop()
        if state.engine is not None:
            state.engine.close()  # stops the tensor-parallel ranks
    if state.boot_error is not None:
        log.error("start-up failed: %s", state.boot_error)
        return 1
    if state.worker is not None and state.worker.error is not None:
        return 1
    return 0
