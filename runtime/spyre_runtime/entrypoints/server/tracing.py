"""Request traces, as vLLM exports them: one OpenTelemetry span per finished engine request, named
`llm_request`, of kind SERVER, under vLLM's attribute names (vllm/tracing.py's SpanAttributes), continuing
the caller's W3C `traceparent` (else a root span), sent by OTLP over HTTP (protobuf).

On when `--otlp-traces-endpoint` (the cli sets OTEL_EXPORTER_OTLP_TRACES_ENDPOINT from it) or the standard
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT is set, unless OTEL_SDK_DISABLED=true. The
exporter and the batch processor read the other standard variables themselves (OTEL_EXPORTER_OTLP_HEADERS,
_TIMEOUT, _COMPRESSION, _CERTIFICATE, OTEL_BSP_SCHEDULE_DELAY, OTEL_SERVICE_NAME...). Off, neither the SDK
nor the exporter is imported (they are in `RequestTracer.__init__` only) and a request pays one `is None`
test; FastAPI imports OpenTelemetry's API package itself."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from spyre_contract.tracing import TRACES_ENDPOINT_VAR, TRACES_PATH, endpoint_error, traces_url

from spyre_runtime.config import ConfigError

ENDPOINT_VAR = "OTEL_EXPORTER_OTLP_ENDPOINT"
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
SPAN_NAME = "llm_request"
SERVICE_NAME = "spyre-runtime"


class SpanAttributes:
    """vLLM's names (vllm/tracing.py), so a trace backend's queries read the same on both servers."""

    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    REQUEST_ID = "gen_ai.request.id"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_N = "gen_ai.request.n"
    RESPONSE_MODEL = "gen_ai.response.model"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def check_endpoint(url: str, name: str) -> str:
    """An OTLP/HTTP URL (http or https, with a host); else a ConfigError naming where it came from."""
    if error := endpoint_error(url):
        raise ConfigError(f"{name}: {error}")
    return url.strip()


def flag_endpoint(url: str) -> str:
    """`--otlp-traces-endpoint`: a collector's address; without a path, its OTLP/HTTP traces path."""
    return traces_url(check_endpoint(url, "--otlp-traces-endpoint"))


def traces_endpoint(environ: Mapping[str, str] | None = None) -> str | None:
    """Where spans go, from the standard variables (as the OTLP exporter reads them), or None: off."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    for var in PROTOCOL_VARS:
        protocol = env.get(var, "").strip()
        if protocol not in ("", "http/protobuf"):
            raise ConfigError(f"{var}={protocol!r}: traces are sent by OTLP over HTTP only (http/protobuf)")
    if env.get(TRACES_ENDPOINT_VAR, "").strip():
        return check_endpoint(env[TRACES_ENDPOINT_VAR], TRACES_ENDPOINT_VAR)
    if env.get(ENDPOINT_VAR, "").strip():
        base = check_endpoint(env[ENDPOINT_VAR], ENDPOINT_VAR)
        return base.rstrip("/") + TRACES_PATH  # the base URL's signal path, as the exporter adds it
    return None


def tracer_from_env(model_name: str, environ: Mapping[str, str] | None = None) -> RequestTracer | None:
    """Read once at start-up, before the port is bound (a bad value exits 2); None when tracing is off."""
    endpoint = traces_endpoint(environ)
    return None if endpoint is None else RequestTracer(endpoint, model_name)


def _wall_ns(monotonic: float, now_ns: int, now_monotonic: float) -> int:
    return now_ns - int((now_monotonic - monotonic) * 1e9)


class RequestTracer:
    """The server's tracer provider (its own, not the global one), its batch processor and exporter."""

    def __init__(self, endpoint: str, model_name: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint = endpoint
        self.model_name = model_name
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("spyre_runtime")
        self._propagator = TraceContextTextMapPropagator()
        self._server = SpanKind.SERVER

    def context(self, headers: Mapping[str, str] | None):
        """The caller's trace context (`traceparent`, `tracestate`), or None: the span is a root."""
        if not headers or "traceparent" not in headers:
            return None
        return self._propagator.extract(carrier={k: headers[k] for k in ("traceparent", "tracestate")
                                                 if k in headers})  # fmt: skip

    def record(self, context, out, params, n: int) -> None:
        """One finished engine request (its final RequestOutput, with timings) as an `llm_request` span."""
        t = out.timings
        if t is None:
            return
        now_ns, now_mono = time.time_ns(), time.monotonic()
        span = self.tracer.start_span(
            SPAN_NAME, context=context, kind=self._server, start_time=_wall_ns(t.arrival, now_ns, now_mono)
        )
        a = SpanAttributes
        attributes = {
            a.REQUEST_ID: out.request_id,
            a.RESPONSE_MODEL: self.model_name,
            a.USAGE_PROMPT_TOKENS: out.num_prompt_tokens,
            a.USAGE_COMPLETION_TOKENS: len(out.token_ids),
            a.USAGE_NUM_SEQUENCES: n,
            a.REQUEST_N: n,
            a.REQUEST_MAX_TOKENS: params.max_tokens,
            a.REQUEST_TEMPERATURE: params.temperature,
            a.REQUEST_TOP_P: params.top_p,
            a.LATENCY_E2E: t.finished - t.arrival,
        }
        if t.queue_seconds is not None:
            attributes[a.LATENCY_TIME_IN_QUEUE] = t.queue_seconds
            attributes[a.LATENCY_TIME_IN_MODEL_INFERENCE] = t.finished - t.scheduled
        if t.ttft_seconds is not None:
            attributes[a.LATENCY_TIME_TO_FIRST_TOKEN] = t.ttft_seconds
            attributes[a.LATENCY_TIME_IN_MODEL_DECODE] = t.finished - t.first_token
            if t.scheduled is not None:
                attributes[a.LATENCY_TIME_IN_MODEL_PREFILL] = t.first_token - t.scheduled
        span.set_attributes(attributes)
        span.end(end_time=_wall_ns(t.finished, now_ns, now_mono))

    def shutdown(self) -> None:
        """Sends what the batch processor still holds."""
        self.provider.shutdown()
