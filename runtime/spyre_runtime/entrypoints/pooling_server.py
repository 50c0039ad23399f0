"""The HTTP server of pooling models (served instead of server.py when the task is embed, score or
rerank): OpenAI's `/v1/embeddings`, vLLM's `/score`, and `/rerank` (also `/v1/rerank`, `/v2/rerank`) in
vLLM's / Jina's / Cohere's format; `/health`, `/metrics`, `/version`, `/v1/models` as the decoder server.

Embedding models serve all of them (score and rerank by cosine similarity of the embeddings, as vLLM);
cross-encoders serve score and rerank. Every input is checked here: an input longer than every warm-up
shape is a 400 naming the shapes unless the request asks for `truncate_prompt_tokens`.

The error body, APIError and the API-key guard follow server.py's (its helpers live in a module under
active change, so this file keeps its own small versions rather than importing the decoder server)."""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
import time
import uuid
from importlib.metadata import PackageNotFoundError, version
from typing import Literal

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import Field

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.pooling import PoolingEngine, PoolingScheduler, PoolItem
from spyre_runtime.entrypoints.metrics import Metrics
from spyre_runtime.entrypoints.protocol import APIError, _Strict, bad_request, error_body, install_guards
from spyre_runtime.executor.pooling_model import (
    PoolingModel,
    PoolingSpec,
    check_shapes,
    detect_pooling,
    shapes_str,
)

log = logging.getLogger(__name__)
MAX_INPUTS = 2048  # inputs (or pairs, or documents) in one request, as OpenAI's embeddings API


# ---- request schemas ------------------------------------------------------------------------------


class _Common(_Strict):
    model: str | None = Field(default=None, max_length=1024)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    user: str | None = Field(default=None, max_length=1024)


class EmbeddingRequest(_Common):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    add_special_tokens: bool | None = None


class ScoreRequest(_Common):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankDocument(_Strict):
    text: str


class RerankRequest(_Common):
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool | None = None


# ---- server state ---------------------------------------------------------------------------------


class PoolingState:
    def __init__(self, config: RuntimeConfig, api_key: str | None = None) -> None:
        self.config = config
        self.api_key = api_key
        self.metrics = Metrics()
        self.spec: PoolingSpec = detect_pooling(config.model_dir, config.task)
        check_shapes(config, self.spec)  # before the port is bound: exit 2 with one line
        self.tokenizer = None
        self.model: PoolingModel | None = None
        self.scheduler = PoolingScheduler(config.shapes)
        self.engine: PoolingEngine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.is_ready = False
        self.boot_error: BaseException | None = None
        self.on_fatal = lambda: None

    def boot(self) -> None:
        """Background thread: tokenizer, model, warm-up of every shape, engine thread."""
        try:
            from transformers import AutoTokenizer

            from spyre_runtime.executor.graph_cache import warmup_with_cache
            from spyre_runtime.executor.model_executor import configure_threads

            configure_threads(self.config)
            self.tokenizer = AutoTokenizer.from_pretrained(self.config.model_dir)
            pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            self.model = PoolingModel(self.config, self.spec, pad_id)
            warm = warmup_with_cache(self.model, self.config)  # the graph cache, when enabled
            self.metrics.warmup_seconds.set(warm.seconds)
            self.engine = PoolingEngine(self.model, self.scheduler)
            self.engine.on_step = self._observe_step
            self.engine.start()
            self.is_ready = True
            log.info(
                "Ready: serving %s (%s) on %s:%d",
                self.config.served_model_name,
                "cross-encoder" if self.spec.is_cross_encoder else "embeddings",
                self.config.host,
                self.config.port,
            )
        except BaseException as e:
            log.exception("start-up failed")
            self.boot_error = e
            self.on_fatal()

    @property
    def is_healthy(self) -> bool:
        return self.is_ready and self.engine is not None and self.engine.is_alive

    def _observe_step(self, step, seconds: float) -> None:
        self.metrics.step_seconds.labels("pool").observe(seconds)
        self.metrics.batch_occupancy.set(step.occupancy)
        self.metrics.queue_length.set(self.scheduler.num_waiting)

    # ---- running inputs -------------------------------------------------------------------------

    async def run(self, rows: list[tuple[list[int], list[int] | None]]) -> list[torch.Tensor]:
        """Submits every row to the engine and waits for all of them (batched with other requests)."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in rows]

        def deliver_to(future: asyncio.Future):
            def deliver(out) -> None:
                loop.call_soon_threadsafe(_settle, future, out)

            return deliver

        items = [PoolItem(ids, types, deliver_to(f)) for (ids, types), f in zip(rows, futures, strict=True)]
        self.engine.submit(items)
        self.metrics.queue_length.set(self.scheduler.num_waiting)
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            for item in items:
                item.is_cancelled = True
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


# ---- input checks ---------------------------------------------------------------------------------


class Inputs:
    """Tokenizes and checks the inputs of one request against the warm-up shapes."""

    def __init__(self, state: PoolingState, truncate: int | None) -> None:
        self.state = state
        self.max_len = state.scheduler.max_len
        if truncate == -1:
            truncate = self.max_len
        if truncate is not None and not 1 <= truncate <= self.max_len:
            raise bad_request(
                "truncate_prompt_tokens",
                f"{truncate} must be -1 or between 1 and {self.max_len}, the longest warm-up prompt length",
            )
        self.truncate = truncate

    def texts(self, texts: list[str], param: str, add_special_tokens: bool = True) -> list[tuple]:
        return self._encode(texts, None, param, add_special_tokens)

    def pairs(self, firsts: list[str], seconds: list[str], param: str) -> list[tuple]:
        return self._encode(firsts, seconds, param, True)

    def _encode(self, firsts, seconds, param: str, add_special_tokens: bool) -> list[tuple]:
        kwargs = {"add_special_tokens": add_special_tokens}
        if self.truncate is not None:
            kwargs |= {"truncation": True, "max_length": self.truncate}
        try:
            enc = self.state.tokenizer(firsts, seconds, **kwargs)
        except Exception as e:  # e.g. lone surrogates, which JSON allows and UTF-8 does not
            raise bad_request(param, f"could not be tokenized: {e}") from None
        types = enc.get("token_type_ids") if self.state.spec.family == "bert" else None
        rows = [(ids, types[i] if types else None) for i, ids in enumerate(enc["input_ids"])]
        for i, (ids, _) in enumerate(rows):
            self._check_length(len(ids), f"{param}[{i}]" if len(rows) > 1 else param)
        return rows

    def token_ids(self, lists: list[list[int]], param: str) -> list[tuple]:
        vocab = len(self.state.tokenizer)
        rows = []
        for i, ids in enumerate(lists):
            where = f"{param}[{i}]" if len(lists) > 1 else param
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(where, f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
            if self.truncate is not None:
                ids = ids[-self.truncate :]
            self._check_length(len(ids), where)
            rows.append((list(ids), None))
        return rows

    def _check_length(self, n: int, where: str) -> None:
        if n == 0:
            raise bad_request(where, "is empty")
        if n > self.max_len:
            raise bad_request(
                where,
                f"{n} tokens fit no warm-up shape [{shapes_str(self.state.config.shapes)}]; shorten it "
                f"or set truncate_prompt_tokens (at most {self.max_len})",
            )


def _count(rows: list[tuple]) -> int:
    return sum(len(ids) for ids, _ in rows)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


# ---- the app --------------------------------------------------------------------------------------


def create_app(state: PoolingState) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        threading.Thread(target=state.boot, name="boot", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.stop()

    app = FastAPI(title="spyre-serve pooling runtime", lifespan=lifespan)
    config = state.config

    install_guards(app, lambda: state.api_key)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [p for p in first.get("loc", ()) if p != "body"]
        param = ".".join(str(p) for p in loc[:1]) or None
        if first.get("type") == "json_invalid":
            param, message = None, "request body is not valid JSON"
        elif first.get("type") == "extra_forbidden" and param:
            message = f"{param}: unknown parameter"
        elif first.get("type") == "missing" and param:
            message = f"{param}: required"
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        log.exception("unexpected error while handling a request")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), 500)

    @app.get("/health")
    async def health():
        if state.boot_error is not None:
            return JSONResponse({"status": "failed"}, status_code=503)
        if not state.is_healthy:
            body: dict = {"status": "warming up"}
            if state.model is not None:  # shapes compiled and warmed so far (the operator shows it)
                body["warming"] = state.model.progress.snapshot()
            return JSONResponse(body, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        if state.model is not None:
            progress = state.model.progress.snapshot()
            state.metrics.warmup_graphs_done.set(progress["done"])
            state.metrics.warmup_graphs_total.set(progress["total"])
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version_():
        try:
            return {"version": version("spyre-serve")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    def model_card() -> dict:
        return {
            "id": config.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "spyre-serve",
            "root": str(config.model_dir),
            "max_model_len": state.scheduler.max_len,
            "task": "score" if state.spec.is_cross_encoder else "embed",
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != config.served_model_name:
            raise APIError(404, f"model {model_id!r} does not exist", "model", "model_not_found")
        return model_card()

    def admit(body: _Common) -> Inputs:
        if not state.is_healthy:
            raise APIError(503, "the server is not ready (warming up or shutting down)")
        if body.model is not None and body.model != config.served_model_name:
            raise APIError(
                404,
                f"model {body.model!r} does not exist; this server serves {config.served_model_name!r}",
                "model",
                "model_not_found",
            )
        return Inputs(state, body.truncate_prompt_tokens)

    def finish(rows: list[tuple]) -> int:
        tokens = _count(rows)
        state.metrics.requests.labels("pooled").inc()
        state.metrics.prompt_tokens.inc(tokens)
        return tokens

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        inputs = admit(body)
        if state.spec.is_cross_encoder:
            raise APIError(
                400, "this model is a cross-encoder: it serves /score and /rerank, not embeddings", "model"
            )
        dim = state.spec.hidden_size
        if body.dimensions is not None and body.dimensions != dim:
            raise bad_request(
                "dimensions",
                f"this model returns {dim}-dimensional embeddings and cannot shorten them "
                f"(not a Matryoshka model); omit dimensions or set it to {dim}",
            )
        raw = body.input
        if isinstance(raw, list) and not raw:
            raise bad_request("input", "must not be empty")
        if isinstance(raw, list) and len(raw) > MAX_INPUTS and not isinstance(raw[0], int):
            raise bad_request("input", f"at most {MAX_INPUTS} inputs in one request")
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        if isinstance(raw, str):
            rows = await asyncio.to_thread(inputs.texts, [raw], "input", add_special)
        elif isinstance(raw[0], str):
            rows = await asyncio.to_thread(inputs.texts, raw, "input", add_special)
        elif isinstance(raw[0], int):
            rows = inputs.token_ids([raw], "input")
        else:
            rows = inputs.token_ids(raw, "input")
        vectors = await state.run(rows)
        tokens = finish(rows)
        as_base64 = body.encoding_format == "base64"
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": _base64(v) if as_base64 else v.tolist(),
            }
            for i, v in enumerate(vectors)
        ]
        return {
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": config.served_model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    async def score_pairs(inputs: Inputs, firsts: list[str], seconds: list[str], params: tuple[str, str]):
        """-> (scores of (firsts[i], seconds[i]), tokens processed)."""
        if state.spec.is_cross_encoder:
            rows = await asyncio.to_thread(inputs.pairs, firsts, seconds, params[1])
            return [float(s) for s in await state.run(rows)], rows
        unique = list(dict.fromkeys(firsts))  # rerank: one query for every document
        rows = await asyncio.to_thread(inputs.texts, unique, params[0])
        rows += await asyncio.to_thread(inputs.texts, seconds, params[1])
        vectors = await state.run(rows)
        query = dict(zip(unique, vectors, strict=False))
        pairs = zip(firsts, vectors[len(unique) :], strict=True)
        return [_cosine(query[a], b) for a, b in pairs], rows

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest):
        inputs = admit(body)
        t1 = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        t2 = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if not t1 or not t2:
            raise bad_request("text_1" if not t1 else "text_2", "must not be empty")
        if len(t1) == 1:
            t1 = t1 * len(t2)
        if len(t1) != len(t2):
            raise bad_request(
                "text_2",
                f"text_1 has {len(t1)} texts and text_2 {len(t2)}: give one text_1, or as many as text_2",
            )
        if len(t2) > MAX_INPUTS:
            raise bad_request("text_2", f"at most {MAX_INPUTS} pairs in one request")
        scores, rows = await score_pairs(inputs, t1, t2, ("text_1", "text_2"))
        tokens = finish(rows)
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": config.served_model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest):
        inputs = admit(body)
        docs = [d if isinstance(d, str) else d.text for d in body.documents]
        if not docs:
            raise bad_request("documents", "must not be empty")
        if len(docs) > MAX_INPUTS:
            raise bad_request("documents", f"at most {MAX_INPUTS} documents in one request")
        scores, rows = await score_pairs(inputs, [body.query] * len(docs), docs, ("query", "documents"))
        tokens = finish(rows)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[: body.top_n]
        with_docs = body.return_documents is not False
        results = [
            {
                "index": i,
                "relevance_score": scores[i],
                **({"document": {"text": docs[i]}} if with_docs else {}),
            }
            for i in order
        ]
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": config.served_model_name,
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    return app


def _base64(vector: torch.Tensor) -> str:
    """OpenAI's base64 encoding: the float32 little-endian bytes."""
    return base64.b64encode(vector.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()).decode()


def serve(config: RuntimeConfig, api_key: str | None = None) -> int:
    state = PoolingState(config, api_key=api_key)
    app = create_app(state)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(uv_config)

    def fatal() -> None:
        server.should_exit = True

    state.on_fatal = fatal
    try:
        server.run()
    finally:
        if state.engine is not None:
            state.engine.stop()
    if state.boot_error is not None:
        log.error("start-up failed: %s", state.boot_error)
        return 1
    return 0
