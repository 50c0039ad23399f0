"""Prometheus metrics of one server, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("spyre_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("spyre_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("spyre_generated_tokens", "Generated tokens", registry=r)
        self.queue_length = Gauge("spyre_queue_length", "Requests waiting to be scheduled", registry=r)
        self.running = Gauge("spyre_running_requests", "Requests in the running batch", registry=r)
        self.batch_occupancy = Gauge(
            "spyre_batch_occupancy", "Live rows / batch size of the last step", registry=r
        )
        self.ttft = Histogram(
            "spyre_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "spyre_inter_token_latency_seconds", "Time between tokens", buckets=LATENCY_BUCKETS, registry=r
        )
        self.step_seconds = Histogram(
            "spyre_engine_step_seconds", "Engine step time", ["kind"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.warmup_graphs_done = Gauge(
            "spyre_warmup_graphs_done", "Graphs compiled and warmed so far at start-up", registry=r
        )
        self.warmup_graphs_total = Gauge("spyre_warmup_graphs", "Graphs to warm at start-up", registry=r)
        self.warmup_seconds = Gauge(
            "spyre_warmup_seconds", "Time spent compiling and warming shapes", registry=r
        )
