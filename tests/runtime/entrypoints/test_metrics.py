"""vLLM's metrics on our /metrics (what llm-d's router, the Gateway API Inference Extension and KEDA/HPA
recipes read): every `vllm:` family has the name, type and labels vLLM 0.27.1 gives it (the reference table
tests/runtime/data/vllm_0.27.1_metrics.json, itself checked against vLLM's loggers.py when vLLM's
environment exists), and the values mean what vLLM's mean under load, on real server processes."""

from __future__ import annotations

import threading
import time

import pytest

from tests.httpclient import HTTP
from tests.runtime.serverproc import ServerProcess
from tests.runtime.vllm_reference import (
    dataclass_fields,
    declared_metrics,
    load_table,
    sample,
    vllm_families,
    vllm_source,
)

GENERATE_METRICS = {
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
}
POOLING_METRICS = {
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:prompt_tokens",
    "vllm:request_success",
    "vllm:e2e_request_latency_seconds",
}
CB_ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
    "SENDNN_INFERENCE_USE_CB": "1",
    "SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES": "2",
    "SENDNN_INFERENCE_CB_KV_LENS": "128,256",
}
CB_ARGS = ("--max-model-len", "256", "--max-num-seqs", "2", "--max-num-batched-tokens", "64")
STATIC_ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
    "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64",
    "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "192",
    "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "2",
}


# ---- the reference table --------------------------------------------------------------------------

MINI_LOGGERS = """
class PrometheusStatLogger:
    def __init__(self):
        labelnames = ["model_name", "engine"]
        g = self._gauge_cls(name="vllm:a", documentation="", labelnames=labelnames)
        c = self._counter_cls(name="vllm:b", documentation="", labelnames=labelnames + ["reason"])
        self.label_x = "x"
        h = self._histogram_cls(name="vllm:c", documentation="", buckets=[1], labelnames=[self.label_x])

    def log_metrics_info(self, type, config_obj):
        metrics_info = config_obj.metrics_info()
        metrics_info["engine"] = ""
        if type == "cache_config":
            name = "vllm:d"
        self._gauge_cls(name=name, documentation="", labelnames=metrics_info.keys())

class Other:
    def f(self):
        self._gauge_cls(name="vllm:not_this_one", labelnames=[])
"""


def test_the_reader_of_vllms_loggers_resolves_names_and_labels():
    assert declared_metrics(MINI_LOGGERS) == {
        "vllm:a": {"type": "gauge", "labels": ["engine", "model_name"]},
        "vllm:b": {"type": "counter", "labels": ["engine", "model_name", "reason"]},
        "vllm:c": {"type": "histogram", "labels": ["x"]},
        "vllm:d": {"type": "gauge", "labels": ["engine"], "labels_from": "CacheConfig"},
    }
    source = "class CacheConfig:\n    A: ClassVar[int] = 1\n    b: int = 2\n    _c: int\n"
    assert dataclass_fields(source, "CacheConfig") == ["b"]


def test_the_reference_table_is_what_vllms_files_declare():
    loggers, cache = vllm_source("v1/metrics/loggers.py"), vllm_source("config/cache.py")
    table = load_table("metrics")
    assert declared_metrics(loggers.read_text()) == table["metrics"]
    assert dataclass_fields(cache.read_text(), "CacheConfig") == table["cache_config_fields"]


def check_against_vllm(text: str, required: set[str], model_name: str) -> dict:
    """Every vllm: family of a /metrics page is one of vLLM's, with its type and label names; the
    required ones are there. -> the families."""
    table = load_table("metrics")
    families = vllm_families(text)
    assert required <= set(families), f"missing: {required - set(families)}"
    for name, (kind, labels, samples) in families.items():
        ref = table["metrics"].get(name)
        if ref is None:  # prometheus_client's companion `<counter or histogram>_created` series, as vLLM's
            assert name.endswith("_created") and name.removesuffix("_created") in table["metrics"], name
            continue
        assert kind == ref["type"], f"{name}: {kind}, vLLM: {ref['type']}"
        if "labels_from" in ref:
            allowed = set(table["cache_config_fields"]) | set(ref["labels"])
            assert {*ref["labels"], "block_size", "num_gpu_blocks"} <= labels <= allowed, (name, labels)
        else:
            assert labels == set(ref["labels"]), f"{name}: {sorted(labels)}, vLLM: {ref['labels']}"
            assert {s.labels["model_name"] for s in samples} == {model_name}, name
            assert {s.labels["engine"] for s in samples} == {"0"}, name
    return families


# ---- continuous batching ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cb_server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-metrics") / "cb.log"
    with ServerProcess(tiny_model, CB_ENV, log, extra_args=CB_ARGS).serving() as srv:
        yield srv


def scrape(server) -> str:
    return HTTP.get(server.base + "/metrics", timeout=10).text


def load_gauges(text: str) -> tuple[float, float, float]:
    return (
        sample(text, "vllm:num_requests_waiting"),
        sample(text, "vllm:num_requests_running"),
        sample(text, "vllm:kv_cache_usage_perc"),
    )


def run_concurrently(server, bodies: list[dict]) -> tuple[list[dict], list[tuple[float, float, float]]]:
    """Posts every completion at once and scrapes the load gauges until all are answered.
    -> (the responses, the (waiting, running, usage) scraped meanwhile)."""
    results: dict[int, dict] = {}

    def post(i: int) -> None:
        r = HTTP.post(server.base + "/v1/completions", json=bodies[i], timeout=120)
        results[i] = r.json()

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    seen = []
    while any(t.is_alive() for t in threads):
        seen.append(load_gauges(scrape(server)))
        time.sleep(0.01)
    for t in threads:
        t.join()
    return [results[i] for i in range(len(bodies))], seen


def wait_idle(server, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(server)
        if load_gauges(text) == (0, 0, 0) or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def completion(prompt: str, max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def test_cb_metrics_are_vllms_names_types_and_labels(cb_server):
    HTTP.post(cb_server.base + "/v1/completions", json=completion("hello", 3), timeout=60)
    text = scrape(cb_server)
    families = check_against_vllm(text, GENERATE_METRICS, "tiny")
    info = families["vllm:cache_config_info"][2][0]
    assert info.value == 1
    # 2 sequences of 256 tokens in 64-token blocks, and the scratch block
    assert info.labels["block_size"] == "64" and info.labels["num_gpu_blocks"] == "9"
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"][2]}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}


def test_cb_load_gauges_and_counters_under_load(cb_server):
    before = wait_idle(cb_server)
    prompts = [f"request number {i} says" for i in range(4)]
    bodies = [completion(p, 120) for p in prompts]
    answers, seen = run_concurrently(cb_server, bodies)
    # two sequences run (max-num-seqs 2), the others wait: seen while the batch was full
    assert any(w >= 1 and r == 2 and u > 0 for w, r, u in seen), seen
    assert all(r <= 2 and 0 <= u <= 1 for _, r, u in seen), seen
    after = wait_idle(cb_server)
    assert load_gauges(after) == (0, 0, 0)  # every block back in the pool when idle

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in answers)
    generated = sum(a["usage"]["completion_tokens"] for a in answers)
    assert generated == 4 * 120
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == generated
    assert delta("vllm:request_success_total", finished_reason="length") == 4
    assert delta("vllm:request_success_total", finished_reason="stop") == 0
    for histogram in (
        "e2e_request_latency_seconds",
        "time_to_first_token_seconds",
        "request_queue_time_seconds",
    ):
        assert delta(f"vllm:{histogram}_count") == 4, histogram
    assert delta("vllm:inter_token_latency_seconds_count") == generated - 4


def test_cb_prefix_cache_counters_count_tokens(cb_server):
    before = wait_idle(cb_server)
    prompt = "the same long prefix " * 10  # about 150 tokens: two full blocks
    first = HTTP.post(cb_server.base + "/v1/completions", json=completion(prompt, 2), timeout=60).json()
    second = HTTP.post(cb_server.base + "/v1/completions", json=completion(prompt, 2), timeout=60).json()
    after = wait_idle(cb_server)
    n = first["usage"]["prompt_tokens"]
    assert n == second["usage"]["prompt_tokens"] > 128
    assert (
        sample(after, "vllm:prefix_cache_queries_total") - sample(before, "vllm:prefix_cache_queries_total")
        == 2 * n
    )
    # the second finds the first's full blocks, never the one holding its last token
    hits = sample(after, "vllm:prefix_cache_hits_total") - sample(before, "vllm:prefix_cache_hits_total")
    assert hits == (n - 1) // 64 * 64


# ---- static batching ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def static_server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-metrics") / "static.log"
    with ServerProcess(tiny_model, STATIC_ENV, log).serving() as srv:
        yield srv


def test_static_batching_usage_is_rows_in_use_over_rows(static_server):
    wait_idle(static_server)
    bodies = [completion(f"static {i}", 150) for i in range(3)]
    answers, seen = run_concurrently(static_server, bodies)
    assert all(a["usage"]["completion_tokens"] == 150 for a in answers)
    # one shape of 2 rows: a running batch holds 1 or 2 of them, the third request waits
    assert any(w >= 1 and r >= 1 for w, r, _ in seen), seen
    assert any(r > 0 and u == r / 2 for _, r, u in seen), seen
    assert all(u in (0, 0.5, 1) for _, _, u in seen), seen
    text = wait_idle(static_server)
    assert load_gauges(text) == (0, 0, 0)
    families = check_against_vllm(text, GENERATE_METRICS, "tiny")
    info = families["vllm:cache_config_info"][2][0].labels
    assert info["enable_prefix_caching"] == "False"
    assert sample(text, "vllm:prefix_cache_queries_total") == 0


# ---- pooling ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def score_server(tmp_path_factory):
    from spyre_runtime.testing.models import write_tiny_cross_encoder

    model = write_tiny_cross_encoder(tmp_path_factory.mktemp("ce"), "bert", seed=3)
    env = {
        "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
        "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64",
        "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "2",
    }
    log = tmp_path_factory.mktemp("vllm-metrics") / "ce.log"
    with ServerProcess(model, env, log, served_name="ce", extra_args=("--task", "score")).serving() as srv:
        yield srv


def test_pooling_server_has_the_subset_that_applies(score_server):
    before = scrape(score_server)
    docs = ["one document", "another document here", "a third"]
    res = HTTP.post(score_server.base + "/score", json={"text_1": "query", "text_2": docs}, timeout=60).json()
    text = scrape(score_server)
    families = check_against_vllm(text, POOLING_METRICS, "ce")
    assert set(families) & GENERATE_METRICS == POOLING_METRICS  # no KV cache, no generation
    assert load_gauges(text) == (0, 0, 0)

    def delta(name, **labels):
        return sample(text, name, **labels) - sample(before, name, **labels)

    # each input is one request, as in vLLM
    assert delta("vllm:request_success_total", finished_reason="stop") == len(docs)
    assert delta("vllm:e2e_request_latency_seconds_count") == len(docs)
    assert delta("vllm:prompt_tokens_total") == res["usage"]["prompt_tokens"]
