"""An API key end to end (issue 40): the operator installed by Helm, the pods run by the local pod runner,
a SpyreModel with spec.auth.apiKey served; the official OpenAI client with the Secret's key gets its answer,
with a wrong key or none a 401; the Secret's data changed, the pods roll and the new key works, with no
failed request from a client that follows the ready endpoints."""

from __future__ import annotations

import base64
import threading
import time

import httpx
import openai
import pytest
from kubernetes import client
from spyre_runtime.testing.models import write_tiny_model

from tests.cluster.stack import LocalStack
from tests.httpclient import HTTP, openai_client

pytestmark = pytest.mark.cluster

NS = "secured"
KEY_ONE, KEY_TWO = "sk-e2e-first-61c2b7", "sk-e2e-second-0d94fa"


def manifest() -> dict:
    return {
        "apiVersion": "spyre-serve.io/v1alpha1",
        "kind": "SpyreModel",
        "metadata": {"name": "tiny"},
        "spec": {
            "model": {"source": "pvc://models/tiny", "servedModelName": "tiny"},
            "replicas": 2,
            "backend": "eager",
            "batching": {"mode": "static", "shapes": [{"promptLength": 64, "newTokens": 16, "batchSize": 2}]},
            "auth": {"apiKey": {"secretRef": {"name": "tiny-key", "key": "api-key"}}},
        },
    }


def put_key(stack, value: str) -> None:
    core = client.CoreV1Api(stack.kube)
    body = {"metadata": {"name": "tiny-key"}, "data": {"api-key": base64.b64encode(value.encode()).decode()}}
    try:
        core.create_namespaced_secret(NS, body)
    except client.ApiException as e:
        if e.status != 409:
            raise
        core.replace_namespaced_secret("tiny-key", NS, body)


def ask(ip: str, key: str, prompt: str = "The capital of France") -> str:
    c = openai_client(f"http://{ip}:8000/v1", api_key=key, timeout=30)
    return c.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0).choices[0].text


def keys_by_ip(stack, keys: dict[str, str]) -> dict[str, str]:
    """Each serving pod's address and the key its template holds (by the template hash)."""
    pods = client.CoreV1Api(stack.kube).list_namespaced_pod(NS, label_selector="spyre-serve.io/model=tiny")
    return {
        p.status.pod_ip: keys.get(p.metadata.labels["spyre-serve.io/template-hash"], "")
        for p in pods.items
        if p.status.pod_ip
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LocalStack(tmp_path_factory.mktemp("auth-e2e")).running(NS) as s:
        write_tiny_model(s.create_models_claim(NS) / "tiny")
        yield s


def test_api_key_guards_v1_then_a_new_key_rolls_the_pods_with_no_failed_request(stack):
    put_key(stack, KEY_ONE)
    stack.apply_model(NS, manifest())
    stack.wait(lambda: stack.is_ready(NS, "tiny", 2), 240, "tiny Ready", lambda: stack.diagnose(NS, "tiny"))
    ips = stack.wait(lambda: len(stack.endpoints(NS, "tiny")) == 2 and stack.endpoints(NS, "tiny"), 30, "2")
    assert ask(ips[0], KEY_ONE)
    with pytest.raises(openai.AuthenticationError) as err:
        ask(ips[0], "sk-wrong")
    assert err.value.status_code == 401
    no_key = HTTP.post(
        f"http://{ips[0]}:8000/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10
    )
    assert no_key.status_code == 401 and no_key.json()["error"]
    # /health stays open to the probes (and /metrics to scrapers)
    assert HTTP.get(f"http://{ips[0]}:8000/health", timeout=10).status_code == 200

    first = stack.model(NS, "tiny")["status"]["templateHash"]
    keys = {first: KEY_ONE}
    failures, served, stop = [], [0], threading.Event()

    def client_loop():
        """A client that follows the ready endpoints, sending each pod the key its Secret data gave it."""
        n = 0
        while not stop.is_set():
            n += 1
            for attempt in range(2):  # one retry on a pod that is just draining, as a load balancer
                ips = stack.endpoints(NS, "tiny")
                try:
                    ip = ips[n % len(ips)]
                    ask(ip, keys_by_ip(stack, keys)[ip], f"request {n}")
                    served[0] += 1
                    break
                except (openai.APIError, httpx.HTTPError, IndexError, KeyError, ZeroDivisionError) as e:
                    if attempt == 1:
                        failures.append(repr(e))
            time.sleep(0.05)

    t = threading.Thread(target=client_loop)
    t.start()
    try:
        put_key(stack, KEY_TWO)
        second = stack.wait(
            lambda: (h := stack.model(NS, "tiny")["status"].get("templateHash")) != first and h,
            60,
            "a new template for the new key",
        )
        keys[second] = KEY_TWO
        stack.wait(
            lambda: (
                stack.is_ready(NS, "tiny", 2) and all(v == KEY_TWO for v in keys_by_ip(stack, keys).values())
            ),
            240,
            "the rollout to the new key",
            lambda: stack.diagnose(NS, "tiny"),
        )
        time.sleep(2)
    finally:
        stop.set()
        t.join(timeout=60)
    assert failures == [] and served[0] > 10
    ip = stack.endpoints(NS, "tiny")[0]
    assert ask(ip, KEY_TWO)
    with pytest.raises(openai.AuthenticationError):
        ask(ip, KEY_ONE)  # the old key is refused once rolled
    log = (stack.workdir / "runner").glob("**/*.log")
    for path in log:  # neither key in any pod's or the operator's log
        text = path.read_text(errors="replace")
        assert KEY_ONE not in text and KEY_TWO not in text, path
