"""Prometheus metrics of one server, in a registry of its own: our `spyre_*` metrics, and the subset of
vLLM's that routers and autoscalers read (VllmMetrics), under vLLM's names, types, labels and meanings."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, model_name: str = "", generate: bool = True, speculation: bool = False) -> None:
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
        self.vllm = VllmMetrics(r, model_name, generate, speculation)
        self.sendnn = SendnnMetrics(r, model_name) if generate else None


# vLLM 0.27.1's buckets (vllm/v1/metrics/loggers.py), so histogram_quantile reads the same on both servers
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason, every one exposed
ENGINE = "0"  # vLLM labels each engine core (data-parallel rank); we run one


class VllmMetrics:
    """vLLM's metrics that an endpoint picker (llm-d's router, the Gateway API Inference Extension) and
    autoscalers (KEDA, HPA) read, with vLLM's labels (`model_name`, `engine`). Counters count tokens as
    vLLM does: prompt tokens once a request's prefill is done (cached ones included), generated tokens as
    they are produced; prefix-cache queries and hits in tokens, for requests admitted for the first time.
    A pooling server (`generate=False`) has the subset that applies to it; each of its inputs is one
    request, as in vLLM."""

    def __init__(
        self, r: CollectorRegistry, model_name: str, generate: bool = True, speculation: bool = False
    ) -> None:
        self.registry = r
        self._names, self._values = ["model_name", "engine"], [model_name, ENGINE]
        self.num_requests_waiting = self._gauge("vllm:num_requests_waiting", "Requests queued, not scheduled")
        self.num_requests_running = self._gauge("vllm:num_requests_running", "Requests in the running batch")
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prompt tokens prefilled (cached ones too)")
        success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason",
            [*self._names, "finished_reason"],
            registry=r,
        )
        self.request_success = {reason: success.labels(*self._values, reason) for reason in FINISH_REASONS}
        self.e2e = self._histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish", REQUEST_LATENCY_BUCKETS
        )
        self.spec_draft_tokens = self.spec_accepted_tokens = None  # vLLM's, with speculation only
        if generate:
            self._generate_metrics()
        if generate and speculation:  # SENDNN_INFERENCE_CB_NGRAM_SPEC_TOKENS
            spec = "vllm:spec_decode_num_"
            self.spec_draft_tokens = self._counter(spec + "draft_tokens", "Draft tokens proposed")
            self.spec_accepted_tokens = self._counter(spec + "accepted_tokens", "Draft tokens kept")

    def _generate_metrics(self) -> None:
        self.kv_cache_usage = self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 0 to 1: blocks held over blocks in the pool (static batching: rows in use over "
            "the rows of the running shape)",
        )
        self.prefix_cache_queries = self._counter("vllm:prefix_cache_queries", "Prompt tokens looked up")
        self.prefix_cache_hits = self._counter("vllm:prefix_cache_hits", "Prompt tokens found in the cache")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Tokens generated")
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "Arrival to first token", TTFT_BUCKETS
        )
        self.itl = self._histogram("vllm:inter_token_latency_seconds", "Time between two tokens", ITL_BUCKETS)
        self.queue_time = self._histogram(
            "vllm:request_queue_time_seconds", "Arrival to first scheduled", REQUEST_LATENCY_BUCKETS
        )

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, self._names, registry=self.registry).labels(*self._values)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, self._names, registry=self.registry).labels(*self._values)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, self._names, buckets=buckets, registry=self.registry).labels(
            *self._values
        )

    def cache_config(self, block_size: int, num_gpu_blocks: int, enable_prefix_caching: bool) -> None:
        """vLLM's info gauge (always 1) whose labels describe the KV cache; vLLM labels it with its
        CacheConfig's fields and `engine`, no `model_name`. `num_gpu_blocks` counts the scratch block, as
        vLLM's counts its null block."""
        labels = {
            "block_size": str(block_size),
            "num_gpu_blocks": str(num_gpu_blocks),
            "enable_prefix_caching": str(enable_prefix_caching),
            "engine": ENGINE,
        }
        info = Gauge(
            "vllm:cache_config_info", "The KV cache's configuration", list(labels), registry=self.registry
        )
        info.labels(**labels).set(1)

    def finished(self, reason: str | None) -> None:
        self.request_success[reason if reason in FINISH_REASONS else "error"].inc()


class SendnnMetrics:
    """sendnn-inference 2.x's scheduler metrics (its v1/metrics/stats_logger.py), beside vLLM's, with the
    same labels: the decode batch, paused requests (the volumetric limit), pause and resume events."""

    def __init__(self, r: CollectorRegistry, model_name: str) -> None:
        names, values = ["model_name", "engine"], [model_name, ENGINE]
        self.decode_batch = Gauge("sendnn:decode_batch", "Requests in the decode batch", names, registry=r)
        self.paused = Gauge("sendnn:paused", "Paused requests", names, registry=r)
        self.pause_events = Counter("sendnn:pause_events", "Times a request was paused", names, registry=r)
        self.resume_events = Counter("sendnn:resume_events", "Times a request was resumed", names, registry=r)
        self._children = [m.labels(*values) for m in (self.decode_batch, self.paused)]
        self._events = [m.labels(*values) for m in (self.pause_events, self.resume_events)]
        self._seen = (0, 0)

    def observe(self, scheduler, step) -> None:
        """After a step, on the engine thread: the step's decode rows and the scheduler's pause counts
        (a static scheduler pauses nothing)."""
        decode_batch, paused = self._children
        rows = step.decode if hasattr(step, "decode") else (() if step.is_prefill else step.requests)
        if rows or not step.is_prefill:  # a prefill-only step leaves the decode batch as it was
            decode_batch.set(len(rows))
        paused.set(getattr(scheduler, "num_paused", 0))
        counts = (getattr(scheduler, "num_pause_events", 0), getattr(scheduler, "num_resume_events", 0))
        for counter, now, before in zip(self._events, counts, self._seen, strict=True):
            counter.inc(now - before)
        self._seen = counts
