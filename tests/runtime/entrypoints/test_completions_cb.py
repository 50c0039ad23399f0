"""The OpenAI server with continuous batching (SENDNN_INFERENCE_USE_CB=1): concurrent streams join one running
batch and each gets what it would get alone; the max model length is enforced at the API with a 400; a client
that hangs up frees its sequence and blocks at once."""

import re
import threading
import time

import openai
import pytest

from tests.httpclient import HTTP
from tests.runtime.entrypoints.test_completions import metric
from tests.runtime.serverproc import ServerProcess

CB_ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor",
    "SENDNN_INFERENCE_USE_CB": "1",
    "SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES": "2,4",
    "SENDNN_INFERENCE_CB_KV_LENS": "128,256",
}
CB_ARGS = ("--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64")


@pytest.fixture(scope="module")
def cb_server(tiny_model, tmp_path_factory):
    srv = ServerProcess(tiny_model, CB_ENV, tmp_path_factory.mktemp("cb") / "server.log", extra_args=CB_ARGS)
    with srv.serving():
        yield srv


@pytest.fixture()
def client(cb_server):
    return cb_server.client(timeout=120)


# ~5, 121 (two prefill chunks), 6 and 21 prompt tokens
PROMPTS = ["The capital of France", "word " * 40, "def add(a, b):", "1 2 3 4 5 6 7 8 9 10 " * 2]


def test_concurrent_streams_share_the_batch_and_match_requests_alone(cb_server, client):
    def complete(prompt, stream):
        kwargs = {"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0}
        if not stream:
            return client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
        chunks = client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in chunks)

    alone = [complete(p, stream=False) for p in PROMPTS]
    results: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, complete(PROMPTS[i], True)))
        for i in range(len(PROMPTS))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results[i] for i in range(len(PROMPTS))] == alone
    # they really ran together: some decode step held more than one live row
    text = HTTP.get(cb_server.base + "/metrics").text
    assert "spyre_batch_occupancy" in text
    assert re.search(
        r"\[Warmup\]\[Decode\]\[\d+/\d+\] batch_size:4 kv_len:\d+ took", cb_server.log_path.read_text()
    )


def test_prompt_plus_max_tokens_over_max_model_len_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="maximum model length") as err:
        client.completions.create(model="tiny", prompt="word " * 60, max_tokens=100)  # 181 + 100
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="maximum model length") as err:
        client.completions.create(model="tiny", prompt="word " * 300, max_tokens=1)
    assert err.value.body["param"] == "prompt"
    # without max_tokens, the room left in the model length is used: accepted
    res = client.completions.create(model="tiny", prompt="word " * 60)
    assert res.choices[0].finish_reason in ("stop", "length")
    assert res.usage.prompt_tokens + res.usage.completion_tokens <= 256


def test_disconnect_mid_stream_frees_its_sequence(cb_server, client):
    before = metric(cb_server, "spyre_requests_total", '{outcome="abort"}')
    body = {"model": "tiny", "prompt": "word " * 10, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with HTTP.stream("POST", cb_server.base + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    deadline = time.monotonic() + 20
    while (
        metric(cb_server, "spyre_requests_total", '{outcome="abort"}') <= before
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert metric(cb_server, "spyre_requests_total", '{outcome="abort"}') == before + 1
    while metric(cb_server, "spyre_running_requests") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(cb_server, "spyre_running_requests") == 0
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_n_logprobs_echo_and_guided_choice_under_continuous_batching(client):
    kw = {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 8,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }
    res = client.completions.create(n=3, seed=5, logprobs=1, **kw)
    singles = [client.completions.create(seed=5 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in res.choices] == singles  # the three ran in one batch, each as it would alone
    assert all(len(c.logprobs.token_logprobs) == 8 for c in res.choices)
    scored = client.completions.create(
        model="tiny", prompt=[5, 6, 7, 8], echo=True, logprobs=0, max_tokens=1, temperature=0
    )
    assert (
        scored.choices[0].logprobs.token_logprobs[0] is None and len(scored.choices[0].logprobs.tokens) == 5
    )
    choices = ["Paris", "Rome"]
    picked = client.completions.create(
        model="tiny", prompt="Capital?", max_tokens=5, seed=1, extra_body={"guided_choice": choices}
    )
    assert picked.choices[0].text in choices
