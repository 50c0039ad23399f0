"""A sick engine fails fast, and a client that hangs up frees its slot at once. Each test runs its own
server (eager backend, a long static shape of batch size 1, so a request left running would be seen)."""

import json
import threading
import time

import httpx
import psutil
import pytest
from spyre_runtime.testing.models import write_tiny_model

from tests.httpclient import HTTP
from tests.runtime.entrypoints.test_completions import metric
from tests.runtime.serverproc import ServerProcess

SLOW_ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
    "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64",
    "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "1900",
    "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "1",
}
LONG = {"model": "tiny", "prompt": "word " * 20, "max_tokens": 1900, "ignore_eos": True}


def ttft(base: str) -> float:
    """Seconds to the first streamed token of a short request."""
    t0 = time.monotonic()
    first = None
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True}
    with HTTP.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():  # read to the end: this request is not abandoned
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - t0
    assert first is not None, "no token streamed"
    return first


def test_engine_failure_fails_in_flight_requests_turns_unhealthy_and_exits_non_zero(tiny_model, tmp_path):
    flag = tmp_path / "fault"
    env = {**SLOW_ENV, "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "2", "SPYRE_TEST_FAULT_FILE": str(flag)}
    srv = ServerProcess(tiny_model, env, tmp_path / "s.log", module="tests.runtime.faulty_engine")
    with srv.serving():
        plain = {}

        def non_streaming():  # queued behind the running batch: in flight, waiting
            plain["res"] = HTTP.post(srv.base + "/v1/completions", json=LONG, timeout=120)

        t = threading.Thread(target=non_streaming)
        events = []
        with HTTP.stream(
            "POST", srv.base + "/v1/completions", json={**LONG, "stream": True}, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 1:
                        t.start()
                    if len(events) == 3:
                        time.sleep(0.5)
                        flag.touch()  # the next step raises
        # sick: unhealthy and refusing at once (for the few seconds before it exits)
        health = HTTP.get(srv.base + "/health", timeout=10).status_code
        t0 = time.monotonic()
        late = HTTP.post(srv.base + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
        late_seconds = time.monotonic() - t0
        t.join(timeout=30)
        assert health == 503
        assert late.status_code == 503 and late_seconds < 1
        assert "engine failed" in late.json()["error"]["message"]
        # in flight: the stream ends with an error event, the queued request with a 500
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert events[-1] == "data: [DONE]" and "engine failed" in error["message"]
        assert plain["res"].status_code == 500 and "engine failed" in plain["res"].json()["error"]["message"]
        # then gone with a non-zero exit
        assert srv.proc.wait(timeout=30) == 1
        assert "engine loop failed" in srv.log()


def test_with_tensor_parallelism_a_failed_step_ends_every_rank(tmp_path):
    model = write_tiny_model(tmp_path / "tiny-8-4", heads=8, kv_heads=4, seed=3)
    flag = tmp_path / "fault"
    env = {**SLOW_ENV, "SPYRE_TEST_FAULT_FILE": str(flag)}
    srv = ServerProcess(
        model,
        env,
        tmp_path / "s.log",
        module="tests.runtime.faulty_engine",
        extra_args=("--tensor-parallel-size", "2"),
    )
    with srv.serving():
        family = psutil.Process(srv.proc.pid).children(recursive=True)
        assert post_completion(srv, max_tokens=3).status_code == 200
        # prompt scoring (echo + logprobs) runs on both ranks too
        scored = post_completion(srv, prompt=[5, 6, 7, 8], echo=True, logprobs=1, max_tokens=1, temperature=0)
        assert scored.status_code == 200, scored.text
        assert all(x <= 0 for x in scored.json()["choices"][0]["logprobs"]["token_logprobs"][1:])
        flag.touch()
        res = post_completion(srv, max_tokens=3)
        assert res.status_code == 500 and "injected fault" in res.json()["error"]["message"]
        assert srv.proc.wait(timeout=30) == 1
        _, alive = psutil.wait_procs(family, timeout=10)  # rank 1 was waiting in a collective: killed
        assert alive == []


def post_completion(srv: ServerProcess, **kw) -> httpx.Response:
    return HTTP.post(srv.base + "/v1/completions", json={"model": "tiny", "prompt": "hi", **kw}, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_frees_its_slot_within_a_step(tiny_model, tmp_path, stream):
    srv = ServerProcess(tiny_model, SLOW_ENV, tmp_path / "s.log")
    with srv.serving():
        baseline = min(ttft(srv.base) for _ in range(3))
        t0 = time.monotonic()
        if stream:  # read the first token, then hang up
            with HTTP.stream("POST", srv.base + "/v1/completions", json={**LONG, "stream": True}) as r:
                next(line for line in r.iter_lines() if line.startswith("data: {"))
        else:  # the client gives up after 1 s and closes the connection
            with pytest.raises(httpx.ReadTimeout):
                HTTP.post(srv.base + "/v1/completions", json=LONG, timeout=1)
        after = ttft(srv.base)
        # the abandoned request would hold the only slot for 1900 tokens; its successor starts at once
        assert after < 3 * baseline + 0.5, (baseline, after)
        assert metric(srv, "spyre_requests_total", '{outcome="abort"}') == 1
        assert metric(srv, "spyre_generated_tokens_total") < 1900
        assert time.monotonic() - t0 < 10
