"""What request traces cost (issue 41: nothing loaded and nothing paid when off), measured, not assumed:

1. a server's start without tracing and with it, in fresh processes: the OpenTelemetry SDK, exporter and
   protobuf modules imported, and the time to import the tracing module and build the server's tracer
   (`tracer_from_env`, as ServingState does; the SDK and the OTLP exporter load only when on);
2. the event loop's cost per finished request: `RequestTracer.record` (one `llm_request` span, its attributes,
   queued to the batch processor) against the `is None` test a request makes when tracing is off;
3. the batch processor's export of those spans to an OTLP/HTTP receiver on 127.0.0.1 (on its own thread).

    .venv/bin/python bench/tracing_bench.py [--spans 2000] [--out bench/results-tracing.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
STARTUP = """
import json, sys, time
t0 = time.perf_counter()
from spyre_runtime.entrypoints.server.tracing import tracer_from_env
tracer = tracer_from_env("m")
print(json.dumps({"seconds": time.perf_counter() - t0, "tracer": tracer is not None,
                  "otel_modules": sum(m.startswith(("opentelemetry.sdk", "opentelemetry.exporter",
                                                    "opentelemetry.proto")) for m in sys.modules)}))
"""


class Sink(BaseHTTPRequestHandler):
    received = 0

    def do_POST(self) -> None:
        Sink.received += int(self.headers["Content-Length"])
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def startup(env: dict, runs: int) -> dict:
    """The median of `runs` fresh processes' import-and-build time, and what they imported."""
    results = []
    for _ in range(runs):
        done = subprocess.run(
            [sys.executable, "-c", STARTUP], env=env, capture_output=True, text=True, check=True, cwd=REPO
        )
        results.append(json.loads(done.stdout.splitlines()[-1]))
    return {
        "tracer": results[0]["tracer"],
        "otel_sdk_modules": results[0]["otel_modules"],
        "import_and_build_s_median": statistics.median(r["seconds"] for r in results),
    }


def fake_output(i: int):
    now = time.monotonic()
    timings = SimpleNamespace(arrival=now - 1.0, scheduled=now - 0.9, first_token=now - 0.5, finished=now)
    timings.queue_seconds, timings.ttft_seconds = 0.1, 0.5
    return SimpleNamespace(
        request_id=f"cmpl-{i}-0", num_prompt_tokens=100, token_ids=(1,) * 50, timings=timings
    )


def per_span(spans: int, endpoint: str) -> dict:
    from spyre_runtime.entrypoints.server.tracing import RequestTracer

    tracer = RequestTracer(endpoint, "m")
    params = SimpleNamespace(max_tokens=64, temperature=0.0, top_p=1.0)
    context = tracer.context({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    outs = [fake_output(i) for i in range(spans)]
    t0 = time.perf_counter()
    for out in outs:
        tracer.record(context, out, params, 1)
    on = (time.perf_counter() - t0) / spans
    t0 = time.perf_counter()
    tracer.shutdown()  # exports what the batch processor still holds
    flush = time.perf_counter() - t0
    trace = None
    t0 = time.perf_counter()
    for out in outs:
        if trace is not None:  # what a request does when tracing is off (completions/submission.py)
            trace.record(context, out, params, 1)
    off = (time.perf_counter() - t0) / spans
    return {"record_us_per_span": on * 1e6, "off_us_per_request": off * 1e6, "final_flush_s": flush}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spans", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per start-up figure")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results-tracing.json")
    args = ap.parse_args()
    sink = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}/v1/traces"
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    res = {
        "startup_off": startup(base, args.runs),
        "startup_on": startup({**base, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint}, args.runs),
        "spans": args.spans,
        **per_span(args.spans, endpoint),
    }
    res["exported_bytes"] = Sink.received
    sink.shutdown()
    text = json.dumps(res, indent=2)
    print(text)
    args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
