"""The OpenAI-compatible HTTP server (FastAPI + uvicorn). The engine runs on its own thread; this module
checks (through protocol.Validator), admits, streams and reports. Model loading and warmup run in the
background so /health can answer 503 until they are done.

A sick engine fails fast: when the engine loop dies, /health turns 503, new requests get 503 at once,
in-flight requests end with an error, and the process exits non-zero (the kubelet restarts it).
A client that hangs up (streaming or not) has its requests aborted at once: their slots are free by the
next engine step."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from importlib.metadata import PackageNotFoundError, version

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.llm_engine import EngineThread, LLMEngine, RequestOutput
from spyre_runtime.entrypoints.metrics import Metrics
from spyre_runtime.entrypoints.protocol import (
    APIError,
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    DetokenizeRequest,
    Limits,
    TokenizeRequest,
    Validator,
    bad_request,
    error_body,
    extra_field_message,
    install_guards,
    param_of,
)
from spyre_runtime.executor.graph_cache import warmup_with_cache
from spyre_runtime.executor.model_executor import configure_threads
from spyre_runtime.sampling.guided import GuideCompiler
from spyre_runtime.sampling.params import TokenLogprob

log = logging.getLogger(__name__)
DEAD_ENGINE_EXIT_DELAY = 5.0  # seconds for in-flight requests to receive their error before exiting


def runtime_version() -> str:
    try:
        return version("spyre-serve")
    except PackageNotFoundError:
        return "unknown"


class EngineDied:
    """Put on every in-flight request's queue when the engine loop dies."""

    def __init__(self, error: BaseException) -> None:
        self.message = f"the engine failed ({type(error).__name__}: {error}); the server is restarting"


# ---- server state --------------------------------------------------------------------------------


class ServerState:
    def __init__(self, config: RuntimeConfig, api_key: str | None = None) -> None:
        self.config = config
        self.api_key = api_key
        self.metrics = Metrics()
        self.engine: LLMEngine | None = None
        self.worker: EngineThread | None = None
        self.validator: Validator | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.streams: dict[str, asyncio.Queue] = {}
        self.is_ready = False
        self.is_draining = False
        self.boot_error: BaseException | None = None
        self.engine_error: BaseException | None = None
        self.startup_timings: dict[str, float] = {}
        self.on_fatal = lambda: None
        self._token_strs: dict[int, str] = {}

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
            self.validator = self._validator(self.engine)
            self.engine.on_step = self._observe_step
            self.worker = EngineThread(self.engine, self._emit, self._engine_died, self._emit_step)
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

    def _validator(self, engine: LLMEngine) -> Validator:
        cfg = self.config
        max_batch = cfg.max_num_seqs if cfg.use_cb else max(s.batch_size for s in cfg.shapes)
        limits = Limits(cfg.served_model_name, engine.vocab_size, max_batch)
        model_vocab = engine.executor.dims.vocab_size or len(engine.tokenizer)
        guides = GuideCompiler(engine.tokenizer, model_vocab, engine.outputs.eos_ids)
        return Validator(limits, engine.scheduler, guides)

    @property
    def is_healthy(self) -> bool:
        return self.is_ready and self.worker is not None and self.worker.is_alive

    def num_in_flight(self) -> int:
        return len(self.streams)

    def token_str(self, token_id: int, as_id: bool = False) -> str:
        if as_id:  # vLLM's return_tokens_as_token_ids: what clients use when strings are ambiguous
            return f"token_id:{token_id}"
        text = self._token_strs.get(token_id)
        if text is None:
            text = self._token_strs[token_id] = self.engine.tokenizer.decode([token_id])
        return text

    # engine thread -> event loop
    def _emit(self, out: RequestOutput) -> None:
        if out.finished:
            self._observe_finished(out)
            self._observe_queue()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._dispatch, out)

    def _emit_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, handed to the event loop in one wake-up (not one per request: each wake-up
        costs the loop a self-pipe write and a selector round that take CPU from the GEMM threads).
        Measured at 8 streams, with the plain ASGI guard (protocol._Guard): 161 -> 175 output tok/s. Making
        the engine wait until the loop had written the step's chunks (so the writes would not overlap the
        next step's GEMMs) measured 165-172: it does not."""
        if not outputs:
            return
        for out in outputs:
            if out.finished:
                self._observe_finished(out)
        if any(out.finished for out in outputs):
            self._observe_queue()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._dispatch_step, outputs)

    def _dispatch_step(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._dispatch(out)

    def _dispatch(self, out: RequestOutput) -> None:
        stream = self.streams.get(out.request_id)
        if stream is not None:
            stream.put_nowait(out)

    def _engine_died(self, error: BaseException) -> None:
        """Engine thread: fail every in-flight request, then end the process (non-zero exit)."""
        self.engine_error = error
        if self.loop is None:
            self.on_fatal()
            return

        def fail_all() -> None:
            died = EngineDied(error)
            for stream in set(self.streams.values()):
                stream.put_nowait(died)
            self.loop.call_later(DEAD_ENGINE_EXIT_DELAY, self.on_fatal)

        self.loop.call_soon_threadsafe(fail_all)

    def _observe_step(self, step, seconds: float) -> None:
        m = self.metrics
        kind = "prefill" if step.is_prefill else "decode"
        m.step_seconds.labels("mixed" if getattr(step, "mixed", False) else kind).observe(seconds)
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


# ---- one HTTP request's sequences ----------------------------------------------------------------


class Submission:
    """The engine requests of one HTTP request (prompts x choices), sharing one queue of outputs."""

    def __init__(self, state: ServerState, rid: str, choices: list[Choice], prompts: list[list[int]]):
        self.state = state
        self.rid = rid
        self.choices = choices
        self.prompts = prompts
        self.queue: asyncio.Queue = asyncio.Queue()
        self.engine_ids = [f"{rid}-{c.index}" for c in choices]
        self.choice_of = dict(zip(self.engine_ids, choices, strict=True))
        self.pending = set(self.engine_ids)

    def submit(self) -> None:
        for eid, choice in zip(self.engine_ids, self.choices, strict=True):
            self.state.streams[eid] = self.queue
            self.state.worker.submit(self.prompts[choice.prompt_index], choice.params, eid)

    def close(self) -> None:
        """Aborts what is still running (the client went away) and forgets the queue."""
        for eid in self.engine_ids:
            self.state.streams.pop(eid, None)
        for eid in self.pending:
            self.state.worker.abort(eid)
        self.pending.clear()

    async def next(self) -> RequestOutput:
        item = await self.queue.get()
        if isinstance(item, EngineDied):
            raise APIError(500, item.message, code="engine_dead")
        if item.finished:
            self.pending.discard(item.request_id)
        return item


async def until_disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body was read already, so the next message is the end)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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

    install_guards(app, lambda: state.api_key)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        param = param_of(tuple(first.get("loc", ())))
        kind = first.get("type")
        if kind == "json_invalid":
            param = None
            message = f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}"
        elif kind == "extra_forbidden" and param:
            message = extra_field_message(param)
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        log.exception("unexpected error while handling a request")
        message = f"internal error: {type(e).__name__}: {e}"
        return JSONResponse(error_body(message, "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        if state.is_draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if state.boot_error is not None or state.engine_error is not None:
            return JSONResponse({"status": "failed"}, status_code=503)
        if not state.is_healthy:
            body: dict = {"status": "warming up"}
            if state.engine is not None:  # graphs compiled and warmed so far (the operator shows it)
                body["warming"] = state.engine.executor.progress.snapshot()
            return JSONResponse(body, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        if state.engine is not None:
            progress = state.engine.executor.progress.snapshot()
            state.metrics.warmup_graphs_done.set(progress["done"])
            state.metrics.warmup_graphs_total.set(progress["total"])
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version_():
        return {"version": runtime_version()}

    def model_card() -> dict:
        return {
            "id": config.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "spyre-serve",
            "root": str(config.model_dir),
            "max_model_len": config.max_model_len,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != config.served_model_name:
            raise APIError(404, f"model {model_id!r} does not exist", "model", "model_not_found")
        return model_card()

    def require_healthy() -> Validator:
        if state.engine_error is not None:
            raise APIError(503, EngineDied(state.engine_error).message, code="engine_dead")
        if not state.is_healthy or state.is_draining:
            raise APIError(503, "the server is not ready (warming up or shutting down)")
        return state.validator

    def tokenize(text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        try:
            return state.engine.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        except Exception as e:  # e.g. lone surrogates, which JSON allows and UTF-8 does not
            raise bad_request(param, f"could not be tokenized: {e}") from None

    def render_chat(v: Validator, body: ChatCompletionRequest | TokenizeRequest) -> str:
        """The chat template's text (vLLM's rule: the template adds the special tokens it wants)."""
        messages = v.messages(body)
        add_generation = body.add_generation_prompt is not False
        if body.continue_final_message:
            if body.add_generation_prompt:
                raise bad_request(
                    "continue_final_message", "cannot be combined with add_generation_prompt: true"
                )
            add_generation = False
        kwargs = dict(body.chat_template_kwargs or {})
        reserved = {"conversation", "messages", "tokenize", "tools", "chat_template", "add_generation_prompt"}
        clash = sorted(reserved & kwargs.keys())
        if clash:
            raise bad_request("chat_template_kwargs", f"may not set {', '.join(clash)}")
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        if isinstance(body, ChatCompletionRequest):
            v.tool_choice(body)
            if body.tool_choice == "none":
                tools = None
        tokenizer = state.engine.tokenizer
        if body.chat_template is None and tokenizer.chat_template is None:
            raise bad_request("messages", "the model has no chat template; pass chat_template")
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=body.chat_template,
                add_generation_prompt=add_generation,
                continue_final_message=bool(body.continue_final_message),
                tokenize=False,
                **kwargs,
            )
        except Exception as e:
            raise bad_request("messages", f"could not be rendered with the chat template: {e}") from None
        if not isinstance(text, str):
            raise bad_request("chat_template", "the template did not render to text")
        return text

    # ---- tokenizer endpoints ---------------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize_endpoint(body: TokenizeRequest):
        v = require_healthy()
        v.model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("prompt", "give exactly one of prompt and messages")
        if body.prompt is not None:
            ids = tokenize(body.prompt, body.add_special_tokens is not False)
        else:
            ids = tokenize(render_chat(v, body), bool(body.add_special_tokens), "messages")
        result = {"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids}
        if body.return_token_strs:
            result["token_strs"] = state.engine.tokenizer.convert_ids_to_tokens(ids)
        return result

    @app.post("/detokenize")
    async def detokenize_endpoint(body: DetokenizeRequest):
        v = require_healthy()
        v.model(body.model)
        v.token_ids(body.tokens, "tokens")
        return {"prompt": state.engine.tokenizer.decode(body.tokens)}

    # ---- completions -----------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        v = require_healthy()
        v.model(body.model)
        prompts = v.prompt_shape(body)
        v.num_sequences(len(prompts), body)
        add_special = body.add_special_tokens is not False
        ids = [tokenize(p, add_special) if isinstance(p, str) else list(p) for p in prompts]
        if body.echo and body.stream:
            raise bad_request("echo", "echo is not supported with stream")
        choices: list[Choice] = []
        for i, prompt_ids in enumerate(ids):
            if not prompt_ids:
                raise bad_request("prompt", "the prompt is empty")
            v.token_ids(prompt_ids, "prompt")
            params = v.sampling(body, len(prompt_ids), chat=False)
            for c in v.choices(body, params, i):
                choices.append(Choice(len(choices), i, c.params))
        return await respond(request, body, ids, choices, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        v = require_healthy()
        v.model(body.model)
        v.num_sequences(1, body)
        ids = tokenize(render_chat(v, body), bool(body.add_special_tokens), "messages")
        if not ids:
            raise bad_request("messages", "the rendered prompt is empty")
        params = v.sampling(body, len(ids), chat=True)
        return await respond(request, body, [ids], v.choices(body, params, 0), chat=True)

    async def respond(request: Request, body, prompts: list[list[int]], choices: list[Choice], chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        sub = Submission(state, rid, choices, prompts)
        state.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        sub.submit()
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                sse(sub, body, created, chat, include_usage), media_type="text/event-stream"
            )
        try:
            finals = await collect(request, sub)
        finally:
            sub.close()
        if finals is None:  # the client went away: nobody reads an answer
            return Response(status_code=499)
        failed = next((o for o in finals.values() if o.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(500, f"the request failed: {failed.error}", code="request_failed")
        return build_response(sub, body, finals, created, chat)

    async def collect(request: Request, sub: Submission) -> dict[str, RequestOutput] | None:
        """Waits for every sequence's final output, or returns None when the client hangs up first."""
        finals: dict[str, RequestOutput] = {}
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            while sub.pending:
                get = asyncio.ensure_future(sub.next())
                done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    return None
                out = get.result()
                if out.finished:
                    finals[out.request_id] = out
            return finals
        finally:
            gone.cancel()

    def build_response(sub: Submission, body, finals: dict[str, RequestOutput], created: int, chat: bool):
        as_ids = bool(body.return_tokens_as_token_ids)
        outs = [finals[eid] for eid in sub.engine_ids]
        picked = pick_best(sub, body, outs)
        choices = []
        for index, (choice, out) in enumerate(picked):
            if chat:
                message = {"role": "assistant", "content": out.text, "tool_calls": []}
                entry = {"index": index, "message": message, "logprobs": None}
                if body.logprobs:
                    entry["logprobs"] = {"content": chat_logprobs(out.logprobs, as_ids)}
            else:
                prompt_ids = sub.prompts[choice.prompt_index]
                text = out.text
                lps = None
                if body.echo:
                    prompt_text = state.engine.tokenizer.decode(prompt_ids)
                    text = prompt_text + text
                if body.logprobs is not None:
                    echoed = prompt_ids if body.echo else []
                    lps = completion_logprobs(echoed, out, body.logprobs, bool(body.echo), as_ids)
                entry = {"index": index, "text": text, "logprobs": lps}
            entry["finish_reason"] = out.finish_reason
            entry["stop_reason"] = out.stop_reason
            choices.append(entry)
        prompt_tokens = sum(len(p) for p in sub.prompts)
        completion_tokens = sum(len(o.token_ids) for o in outs)
        return {
            "id": sub.rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": config.served_model_name,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
            "system_fingerprint": None,
        }

    def pick_best(sub: Submission, body, outs: list[RequestOutput]) -> list[tuple[Choice, RequestOutput]]:
        """With best_of > n: the n sequences of highest cumulative logprob per prompt, in that order."""
        pairs = list(zip(sub.choices, outs, strict=True))
        n = body.n or 1
        best_of = getattr(body, "best_of", None) or n
        if best_of <= n:
            return pairs
        picked = []
        for prompt_index in range(len(sub.prompts)):
            mine = [p for p in pairs if p[0].prompt_index == prompt_index]
            mine.sort(key=lambda p: p[1].cumulative_logprob, reverse=True)
            picked.extend(mine[:n])
        return picked

    def chat_logprobs(lps: tuple[TokenLogprob, ...], as_ids: bool) -> list[dict]:
        def entry(token_id: int, logprob: float) -> dict:
            text = state.token_str(token_id, as_ids)
            return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode())}

        return [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, x) for t, x in lp.top]} for lp in lps
        ]

    def completion_logprobs(
        prompt_ids: list[int], out: RequestOutput, num_top: int, echo: bool, as_ids: bool
    ) -> dict:
        """OpenAI's legacy layout: tokens, token_logprobs, top_logprobs (the top num_top, plus the chosen
        token, as vLLM), text_offset. With echo the prompt's tokens come first (the first has no logprob)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        entries: list[tuple[int, TokenLogprob | None]] = []
        if echo:
            prompt_lps = out.prompt_logprobs or (None,) * len(prompt_ids)
            entries.extend(zip(prompt_ids, prompt_lps, strict=True))
        entries.extend((lp.token_id, lp) for lp in out.logprobs)
        for token_id, lp in entries:
            text = state.token_str(token_id, as_ids)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if lp is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(_clamp(lp.logprob))
            top = {state.token_str(t, as_ids): _clamp(x) for t, x in lp.top[:num_top]}
            top.setdefault(text, _clamp(lp.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def sse(sub: Submission, body, created: int, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        as_ids = bool(body.return_tokens_as_token_ids)
        obj = "chat.completion.chunk" if chat else "text_completion"
        completion_tokens = 0

        def chunk(choice: dict | None, usage_: dict | None = None) -> str:
            payload = {
                "id": sub.rid,
                "object": obj,
                "created": created,
                "model": config.served_model_name,
                "choices": [{"stop_reason": None, **choice}] if choice else [],
            }
            if include_usage:
                payload["usage"] = usage_
            return f"data: {json.dumps(payload)}\n\n"

        try:
            if chat:
                for choice in sub.choices:
                    delta = {"role": "assistant", "content": ""}
                    yield chunk(
                        {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}
                    )
            while sub.pending:
                try:
                    out = await sub.next()
                except APIError as e:
                    yield f"data: {json.dumps(error_body(e.message, 'server_error', code=e.code))}\n\n"
                    break
                index = sub.choice_of[out.request_id].index
                if out.finish_reason == "error":
                    error = error_body(
                        f"the request failed: {out.error}", "server_error", code="request_failed"
                    )
                    yield f"data: {json.dumps(error)}\n\n"
                    break
                reason = out.finish_reason if out.finished else None
                if out.finished:
                    completion_tokens += len(out.token_ids)
                if not (out.delta_text or out.delta_logprobs or out.finished):
                    continue
                if chat:
                    delta = {"content": out.delta_text} if out.delta_text else {}
                    lps = {"content": chat_logprobs(out.delta_logprobs, as_ids)} if body.logprobs else None
                    yield chunk(
                        {"index": index, "delta": delta, "logprobs": lps, "finish_reason": reason}
                        | ({"stop_reason": out.stop_reason} if out.finished else {})
                    )
                else:
                    lps = None
                    if body.logprobs is not None:
                        lps = completion_logprobs([], _delta(out), body.logprobs, False, as_ids)
                    yield chunk(
                        {"index": index, "text": out.delta_text, "logprobs": lps, "finish_reason": reason}
                        | ({"stop_reason": out.stop_reason} if out.finished else {})
                    )
            else:
                if include_usage:
                    prompt_tokens = sum(len(p) for p in sub.prompts)
                    yield chunk(None, usage(prompt_tokens, completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            sub.close()  # aborts whatever is still running when the client went away

    return app


def _delta(out: RequestOutput) -> RequestOutput:
    import dataclasses

    return dataclasses.replace(out, logprobs=out.delta_logprobs)


def _clamp(logprob: float) -> float:
    """JSON has no -Infinity: a token the model gives no chance gets the most negative float (vLLM)."""
    return max(logprob, -9999.0)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
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


ENGINE_DIED_EXIT_CODE = 1


def serve(config: RuntimeConfig, api_key: str | None = None) -> int:
    state = ServerState(config, api_key=api_key)
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
            with suppress(Exception):
                state.engine.close(failed=state.engine_error is not None)  # stops the tensor-parallel ranks
    if state.boot_error is not None:
        log.error("start-up failed: %s", state.boot_error)
        return 1
    if state.engine_error is not None:
        log.error("exiting: the engine failed: %s", state.engine_error)
        return ENGINE_DIED_EXIT_CODE
    return 0
