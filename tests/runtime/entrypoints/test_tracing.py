"""Request traces (entrypoints/server/tracing.py) on a real server process, sent to a real OTLP/HTTP
receiver started by the test (decoded with opentelemetry-proto): one `llm_request` span per request under
vLLM's attribute names, continuing the caller's `traceparent`, a root span without one; neither the
SDK nor the exporter imported when tracing is off; bad endpoints stop start-up with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.httpclient import HTTP
from tests.runtime.serverproc import ServerProcess

ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
    "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64",
    "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "16",
    "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "2",
    "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: the batch processor sends spans a tenth of a second after
}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP traces receiver on 127.0.0.1: keeps every span it is sent, with its resource."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict, object]] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def wait_for(self, count: int, timeout: float = 30) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.spans) >= count:
                    return list(self.spans)
            time.sleep(0.05)
        raise AssertionError(f"{len(self.spans)} spans received in {timeout} s, want {count}")


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        server: Receiver = self.server
        with server.lock:
            server.paths.append(self.path)
            for rs in request.resource_spans:
                resource = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    server.spans.extend((resource, span) for span in ss.spans)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args) -> None:
        pass


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


@pytest.fixture(scope="module")
def receiver():
    rx = Receiver()
    thread = threading.Thread(target=rx.serve_forever, daemon=True)
    thread.start()
    yield rx
    rx.shutdown()
    rx.server_close()


@pytest.fixture(scope="module")
def traced(tiny_model, tmp_path_factory, receiver):
    """The tiny model served with --otlp-traces-endpoint pointing at the receiver (no path: the flag
    adds /v1/traces)."""
    log = tmp_path_factory.mktemp("traced") / "server.log"
    args = ("--otlp-traces-endpoint", receiver.endpoint)
    with ServerProcess(tiny_model, ENV, log, extra_args=args).serving() as srv:
        yield srv


def complete(server, headers: dict | None = None, **body) -> dict:
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 5, "temperature": 0, **body}
    r = HTTP.post(server.base + "/v1/completions", json=body, headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_request_with_traceparent_continues_the_callers_trace(traced, receiver):
    before = len(receiver.spans)
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    reply = complete(traced, headers, max_tokens=6, top_p=0.9)
    (resource, span), *_ = receiver.wait_for(before + 1)[before:]
    assert receiver.paths[-1] == "/v1/traces"
    assert resource["service.name"] == "spyre-runtime"
    assert span.name == "llm_request"
    assert span.kind == span.SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID
    assert span.parent_span_id.hex() == PARENT_ID
    attrs = attributes(span)
    usage = reply["usage"]
    assert attrs["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 6
    assert attrs["gen_ai.request.id"].startswith("cmpl-")
    assert attrs["gen_ai.response.model"] == "tiny"
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.request.temperature"] == 0
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attrs["gen_ai.request.n"] == 1
    queue, ttft, e2e = (attrs[f"gen_ai.latency.{k}"] for k in ("time_in_queue", "time_to_first_token", "e2e"))
    assert 0 <= queue <= ttft <= e2e
    duration = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
    assert duration == pytest.approx(e2e, abs=0.01)
    assert abs(span.end_time_unix_nano / 1e9 - time.time()) < 30  # wall-clock times, not monotonic ones


def test_a_request_without_traceparent_is_a_root_span_one_per_choice(traced, receiver):
    before = len(receiver.spans)
    complete(traced, n=2, temperature=1.0, seed=1)
    spans = [span for _, span in receiver.wait_for(before + 2)[before:]]
    assert len(spans) == 2
    assert all(span.parent_span_id == b"" for span in spans)
    assert len({span.trace_id for span in spans}) == 2  # two roots, two traces
    assert {attributes(s)["gen_ai.request.n"] for s in spans} == {2}
    assert len({attributes(s)["gen_ai.request.id"] for s in spans}) == 2


def test_a_streamed_chat_request_is_traced(traced, receiver):
    before = len(receiver.spans)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    with HTTP.stream("POST", traced.base + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        r.read()
    (_, span), *_ = receiver.wait_for(before + 1)[before:]
    assert span.trace_id.hex() == TRACE_ID
    assert attributes(span)["gen_ai.request.id"].startswith("chatcmpl-")


PROBE = """
import json, sys
OURS = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto")
from spyre_runtime.config import load_config
from spyre_runtime.entrypoints.api_server import build_app, build_state
state = build_state(load_config(sys.argv[1]))
build_app(state)
print(json.dumps({"tracer": state.tracer is not None,
                  "otel": sorted(m for m in sys.modules if m.startswith(OURS))}))
"""


def probe(tiny_model, **env) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tiny_model)], env={**clean, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_nothing_of_opentelemetry_is_imported_when_tracing_is_off(tiny_model):
    """The SDK, the exporter and the protobuf messages (FastAPI itself imports OpenTelemetry's API)."""
    off = probe(tiny_model)
    assert off == {"tracer": False, "otel": []}
    endpoint = "http://127.0.0.1:4318"
    on = probe(tiny_model, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint)
    assert on["tracer"] is True and "opentelemetry.sdk.trace" in on["otel"]  # the probe can see them
    disabled = probe(tiny_model, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_SDK_DISABLED="true")
    assert disabled == {"tracer": False, "otel": []}


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (("--otlp-traces-endpoint", "collector:4318"), {}, "--otlp-traces-endpoint"),
        (("--otlp-traces-endpoint", "http://collector:99999"), {}, "bad port"),
        ((), {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "ftp://collector"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        ((), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        ((), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "grpc"),
    ],
)
def test_a_bad_endpoint_stops_start_up_with_one_line(tiny_model, args, env, named):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    argv = [sys.executable, "-m", "spyre_runtime.cli", "serve", str(tiny_model), "--port", "1", *args]
    done = subprocess.run(argv, env={**clean, **ENV, **env}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("spyre-runtime: error:")]
    assert len(errors) == 1 and named in errors[0], done.stderr
    assert "Traceback" not in done.stderr
