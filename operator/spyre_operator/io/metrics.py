"""The operator's Prometheus metrics (a registry of its own, no global state) and its health endpoint:
/metrics, /healthz (the process and its loops are alive), /readyz (leading, or a healthy standby)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.core import GaugeMetricFamily


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.reconciles = PromCounter(
            "spyre_operator_reconciles", "Reconcile passes by result", ["result"], registry=self.registry
        )
        self.reconcile_seconds = Histogram(
            "spyre_operator_reconcile_seconds",
            "Duration of one reconcile pass",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.api_errors = PromCounter(
            "spyre_operator_api_errors",
            "Failed API calls by object kind and HTTP status",
            ["kind", "code"],
            registry=self.registry,
        )
        self._lock = threading.Lock()
        self._phases: dict[tuple[str, str], str] = {}
        self._pods: dict[tuple[str, str], Counter] = {}
        self._jobs: dict[tuple[str, str], str] = {}
        self.queue_depth: Callable[[], int] = lambda: 0
        self.is_leader: Callable[[], bool] = lambda: True
        self.registry.register(_StateCollector(self))

    def observe_model(self, key, phase: str, pods: Counter, job: str | None) -> None:
        with self._lock:
            self._phases[key] = phase
            self._pods[key] = pods
            if job is None:
                self._jobs.pop(key, None)
            else:
                self._jobs[key] = job

    def forget(self, key) -> None:
        with self._lock:
            self._phases.pop(key, None)
            self._pods.pop(key, None)
            self._jobs.pop(key, None)

    def snapshot(self) -> tuple[Counter, Counter, Counter]:
        with self._lock:
            pods = Counter()
            for c in self._pods.values():
                pods.update(c)
            return Counter(self._phases.values()), pods, Counter(self._jobs.values())


class _StateCollector:
    """Gauges computed at scrape time from what the last reconcile of each model saw."""

    def __init__(self, metrics: OperatorMetrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        phases, pods, jobs = self.metrics.snapshot()
        for name, help_, label, counts in (
            ("spyre_operator_models", "SpyreModels by phase", "phase", phases),
            ("spyre_operator_pods", "Inference pods by state", "state", pods),
            ("spyre_operator_compile_jobs", "Compile Jobs of current cache keys by state", "state", jobs),
        ):
            family = GaugeMetricFamily(name, help_, labels=[label])
            for value, n in sorted(counts.items()):
                family.add_metric([value], n)
            yield family
        depth = GaugeMetricFamily("spyre_operator_workqueue_depth", "Keys waiting in the work queue")
        depth.add_metric([], self.metrics.queue_depth())
        yield depth
        leader = GaugeMetricFamily("spyre_operator_is_leader", "1 when this replica holds the Lease")
        leader.add_metric([], 1 if self.metrics.is_leader() else 0)
        yield leader


def serve_health(
    port: int, metrics: OperatorMetrics, is_alive: Callable[[], bool], host: str = "0.0.0.0"
) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/metrics":
                body, ctype, code = generate_latest(metrics.registry), CONTENT_TYPE_LATEST, 200
            elif self.path in ("/healthz", "/readyz"):
                ok = is_alive()
                body, ctype, code = (b"ok" if ok else b"unhealthy"), "text/plain", 200 if ok else 503
            else:
                body, ctype, code = b"not found", "text/plain", 404
            try:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                # the probe or scraper hung up first (its timeout on a loaded node): nobody to answer, and
                # not an error of this process (the stdlib server would print a traceback to stderr)
                self.close_connection = True

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server
