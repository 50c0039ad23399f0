"""The OpenAI-compatible server, driven with the official `openai` client and raw HTTP for bad input."""

import json
import re
import signal
import threading
import time

import openai
import pytest

from tests.httpclient import HTTP
from tests.runtime.serverproc import ServerProcess

SHAPE_ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor",
    "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64,128",
    "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "32,64",
    "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "4,2",
}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    perf_dir = tmp_path_factory.mktemp("perf")
    env = {
        **SHAPE_ENV,
        "SENDNN_INFERENCE_PERF_METRIC_LOGGING_ENABLED": "1",
        "SENDNN_INFERENCE_PERF_METRIC_LOGGING_DIR": str(perf_dir),
    }
    srv = ServerProcess(tiny_model, env, tmp_path_factory.mktemp("logs") / "server.log")
    srv.perf_dir = perf_dir
    with srv.serving():
        yield srv


@pytest.fixture()
def client(server):
    return server.client()


def test_health_is_503_until_warm_then_200(server):
    assert server.health_codes[0] == 503 and server.health_codes[-1] == 200
    assert "Warmup finished in" in server.log()


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_and_usage(client):
    res = client.completions.create(
        model="tiny",
        prompt="The capital of France",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert res.choices[0].finish_reason == "length"
    assert res.usage.completion_tokens == 7 and res.usage.prompt_tokens > 0
    again = client.completions.create(
        model="tiny",
        prompt="The capital of France",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert again.choices[0].text == res.choices[0].text


def test_streaming_completion_matches_non_streaming(client):
    kwargs = {
        "model": "tiny",
        "prompt": "Hello, world!",
        "max_tokens": 12,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streaming_and_not(client):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    res = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    assert res.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == res.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == res.usage.completion_tokens


def test_raw_sse_ends_with_done(server):
    body = {"model": "tiny", "prompt": "1 2 3", "max_tokens": 3, "stream": True}
    with HTTP.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_stop_token_ids_and_stop_strings(client):
    base = client.completions.create(
        model="tiny", prompt="def add(a, b):", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    ids_res = client.completions.create(
        model="tiny",
        prompt="def add(a, b):",
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.completions.create(
        model="tiny",
        prompt="def add(a, b):",
        max_tokens=10,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.find(stop)]
    assert ids_res.choices[0].text == text


def test_seed_reproducible_over_http(client):
    kw = {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 42,
        "extra_body": {"ignore_eos": True},
    }
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def post(server, path, payload=None, content=None):
    return HTTP.post(
        server.base + path,
        json=payload,
        content=content,
        timeout=30,
        headers={"content-type": "application/json"},
    )


@pytest.mark.parametrize(
    ("payload", "status", "needle"),
    [
        (None, 400, "not valid JSON"),
        ({"model": "tiny"}, 400, "prompt"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"model": "nope", "prompt": "hi"}, 404, "does not exist"),
        ({"model": "tiny", "prompt": ""}, 400, "empty"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 65}, 400, "compiled shapes: (prompt_len=64"),
        ({"model": "tiny", "prompt": "word " * 300, "max_tokens": 1}, 400, "fits no compiled shape"),
    ],
)
def test_bad_requests_get_openai_errors_and_server_stays_up(server, payload, status, needle):
    res = post(
        server,
        "/v1/completions",
        payload,
        content=b'{"model": "tiny", "prompt": ' if payload is None else None,
    )
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert HTTP.get(server.base + "/health").status_code == 200


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="fits no compiled shape"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x " * 400}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[])


def metric(server, name, labels=""):
    for line in HTTP.get(server.base + "/metrics").text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
            return float(line.split()[-1])
    return 0.0


def test_disconnect_mid_stream_frees_the_slot(tiny_model, tmp_path):
    # a long generation (1024 tokens, batch size 1) so the hang-up surely comes before the end
    env = {"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "1024"}
    srv = ServerProcess(tiny_model, env, tmp_path / "s.log")
    try:
        srv.wait_ready()
        body = {
            "model": "tiny",
            "prompt": "word " * 20,
            "max_tokens": 1024,
            "stream": True,
            "ignore_eos": True,
        }
        with HTTP.stream("POST", srv.base + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # got the first token, hang up
        deadline = time.monotonic() + 20
        while metric(srv, "spyre_requests_total", '{outcome="abort"}') < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(srv, "spyre_requests_total", '{outcome="abort"}') == 1
        assert metric(srv, "spyre_generated_tokens_total") < 1024
        # the only slot is free again: a new request is served at once
        c = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=30)
        assert c.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    finally:
        srv.stop()


def test_metrics_and_perf_log(server, client):
    client.completions.create(model="tiny", prompt="metrics", max_tokens=4, extra_body={"ignore_eos": True})
    text = HTTP.get(server.base + "/metrics").text
    for name in (
        "spyre_requests_total",
        "spyre_prompt_tokens_total",
        "spyre_generated_tokens_total",
        "spyre_queue_length",
        "spyre_batch_occupancy",
        "spyre_time_to_first_token_seconds_bucket",
        "spyre_inter_token_latency_seconds_bucket",
        "spyre_warmup_seconds",
    ):
        assert name in text
    assert metric(server, "spyre_warmup_seconds") > 0
    records = [json.loads(x) for x in (server.perf_dir / "spyre_perf_request.jsonl").read_text().splitlines()]
    assert records and {"queue_seconds", "ttft_seconds", "itl_seconds", "generated_tokens"} <= set(
        records[-1]
    )
    startup = json.loads((server.perf_dir / "spyre_perf_startup.jsonl").read_text().splitlines()[0])
    assert startup["warmup_seconds"] > 0


def test_requests_are_accepted_while_a_batch_computes(server, client):
    results = []

    def one(i):
        r = client.completions.create(
            model="tiny", prompt=f"{i} apples", max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
        )
        results.append(r.usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [20] * 10


def _requests_running(srv) -> float:
    for line in HTTP.get(srv.base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_sigterm_drains_in_flight_then_exits_0(tiny_model, tmp_path):
    # 256 tokens: in flight for seconds, and well inside the runtime's 30 s drain even on a loaded machine
    srv = ServerProcess(
        tiny_model,
        {"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "256"},
        tmp_path / "s.log",
    )
    try:
        srv.wait_ready()
        got = {}

        def long_request():
            c = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=60)
            got["res"] = c.completions.create(
                model="tiny", prompt="slow", max_tokens=256, extra_body={"ignore_eos": True}
            )

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 30
        while _requests_running(srv) < 1:  # SIGTERM only once the request is admitted and running
            assert time.monotonic() < deadline, "the long request never started running"
            time.sleep(0.02)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        late = post(srv, "/v1/completions", {"model": "tiny", "prompt": "late", "max_tokens": 2})
        assert late.status_code == 503
        t.join(timeout=60)
        assert got["res"].usage.completion_tokens == 256
        assert srv.proc.wait(timeout=30) == 0
        # the log names the request the drain waited for, and where it was (engine/client.describe_in_flight)
        drained = r"SIGTERM: draining 1 in-flight requests: cmpl-\w+-0 \([\d.]+ s, running, \d+ tokens\)"
        assert re.search(drained, (tmp_path / "s.log").read_text())
    finally:
        srv.stop()
