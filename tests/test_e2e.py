"""End to end on one machine: the operator installed by Helm and run by the local pod runner, a SpyreModel
applied, a Ready model behind its Service answering the official OpenAI client; scale, a rollout under
load with no failed request, deletion. (Two replicas sharing the graph cache run on the real node:
tests/test_real_node.py.)"""

from __future__ import annotations

import ipaddress
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from spyre_runtime.testing.models import write_tiny_model

from tests.cluster.stack import LocalStack
from tests.hf_greedy import hf_greedy_text
from tests.httpclient import openai_client

pytestmark = pytest.mark.cluster

NS = "inference"


def model_manifest(replicas: int, shapes: list[dict]) -> dict:
    return {
        "apiVersion": "spyre-serve.io/v1alpha1",
        "kind": "SpyreModel",
        "metadata": {"name": "tiny"},
        "spec": {
            "model": {"source": "pvc://models/tiny", "servedModelName": "tiny"},
            "cards": 1,
            "replicas": replicas,
            "backend": "eager",
            "batching": {"mode": "static", "shapes": shapes},
        },
    }


SHAPES_A = [{"promptLength": 64, "newTokens": 16, "batchSize": 2}]
SHAPES_B = [
    {"promptLength": 64, "newTokens": 16, "batchSize": 2},
    {"promptLength": 128, "newTokens": 8, "batchSize": 1},
]


def ask(ip: str, prompt: str | list[int] = "The capital of France") -> str:
    c = openai_client(f"http://{ip}:8000/v1", timeout=30)
    return c.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0).choices[0].text


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LocalStack(tmp_path_factory.mktemp("e2e")).running(NS) as s:
        s.tiny_dir = write_tiny_model(s.create_models_claim(NS) / "tiny")
        yield s


def test_model_becomes_ready_and_answers_through_its_service(stack):
    stack.apply_model(NS, model_manifest(1, SHAPES_A))
    stack.wait(lambda: stack.is_ready(NS, "tiny", 1), 180, "tiny Ready", lambda: stack.diagnose(NS, "tiny"))
    ips = stack.wait(lambda: stack.endpoints(NS, "tiny"), 30, "a ready endpoint")
    assert ipaddress.ip_address(ips[0]).is_loopback and ips[0] != "127.0.0.1"  # the pod's own address
    assert ask(ips[0]) == hf_greedy_text(stack.tiny_dir, "The capital of France", 4)
    out = stack.kubectl("get", "spyremodels", "-n", NS)
    assert "tiny" in out and "Ready" in out


def test_scale_to_two_replicas_both_answer(stack):
    stack.apply_model(NS, model_manifest(2, SHAPES_A))
    stack.wait(
        lambda: stack.is_ready(NS, "tiny", 2), 180, "2 replicas Ready", lambda: stack.diagnose(NS, "tiny")
    )
    ips = stack.wait(
        lambda: len(stack.endpoints(NS, "tiny")) == 2 and stack.endpoints(NS, "tiny"), 30, "2 endpoints"
    )
    answers = {ip: ask(ip) for ip in ips}
    assert len(answers) == 2  # same weights, greedy: the same, known answer
    assert set(answers.values()) == {hf_greedy_text(stack.tiny_dir, "The capital of France", 4)}


def test_rollout_under_load_fails_no_request(stack):
    failures, served, stop = [], [0], threading.Event()

    def client_loop():
        n = 0
        while not stop.is_set():
            n += 1
            # a load balancer's behaviour: current ready endpoints; one retry on a pod that is just draining
            for attempt in range(2):
                ips = stack.endpoints(NS, "tiny")
                try:
                    ask(ips[n % len(ips)], f"request {n}")
                    served[0] += 1
                    break
                except (openai.APIError, httpx.HTTPError, IndexError, ZeroDivisionError) as e:
                    if attempt == 1:
                        failures.append(repr(e))
            time.sleep(0.05)

    t = threading.Thread(target=client_loop)
    t.start()
    try:
        before = stack.model(NS, "tiny")["status"]["templateHash"]
        stack.apply_model(NS, model_manifest(2, SHAPES_B))
        stack.wait(
            lambda: stack.model(NS, "tiny")["status"].get("templateHash") != before, 30, "a new template"
        )
        stack.wait(
            lambda: stack.is_ready(NS, "tiny", 2), 240, "rollout done", lambda: stack.diagnose(NS, "tiny")
        )
        time.sleep(2)
    finally:
        stop.set()
        t.join(timeout=60)
    assert failures == []
    assert served[0] > 10
    # the new shapes are live: a 100-token prompt now fits
    ip = stack.endpoints(NS, "tiny")[0]
    assert ask(ip, [5] * 100) == hf_greedy_text(stack.tiny_dir, [5] * 100, 4)


def test_delete_stops_processes_and_removes_objects(stack):
    procs = [rp.proc for rp in stack.runner.pods.values() if rp.namespace == NS and rp.proc is not None]
    assert procs
    stack.kubectl("delete", "spyremodel", "tiny", "-n", NS, "--wait=false")
    stack.wait(
        lambda: not [rp for rp in stack.runner.pods.values() if rp.namespace == NS], 90, "pods stopped"
    )
    assert all(p.poll() is not None for p in procs)
    stack.wait(
        lambda: (
            "No resources" in stack.kubectl("get", "pods,services", "-n", NS)
            or not stack.kubectl("get", "pods,services", "-n", NS).strip()
        ),
        60,
        "objects gone",
    )


def test_embedding_example_answers_the_openai_client_through_its_service(stack):
    """The embedding example (examples/embedding.yaml: task embed, all-MiniLM-L6-v2), eager and smaller
    shapes so that it warms quickly, applied through the operator and asked through its Service."""
    import shutil

    import yaml
    from spyre_runtime.testing.models import prepare_minilm

    from tests.conftest import REPO

    folder = prepare_minilm(Path.home() / ".cache/spyre-serve/models/minilm")
    target = stack.model_claim_dir(NS, "models") / "minilm"
    if not target.exists():
        shutil.copytree(folder, target)
    manifest = yaml.safe_load((REPO / "examples/embedding.yaml").read_text())
    manifest["spec"]["backend"] = "eager"
    manifest["spec"]["batching"]["shapes"] = [{"promptLength": 64, "batchSize": 2}]
    stack.apply_model(NS, manifest)
    stack.wait(
        lambda: stack.is_ready(NS, "minilm", 1),
        300,
        "the embedding model Ready",
        lambda: stack.diagnose(NS, "minilm"),
    )
    assert stack.kubectl("get", "spyremodel", "minilm", "-n", NS, "-o", "jsonpath={.spec.task}") == "embed"
    ip = stack.endpoints(NS, "minilm")[0]
    c = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key="unused", max_retries=0, timeout=60)
    out = c.embeddings.create(
        model="all-minilm-l6-v2", input=["a cat sat on the mat", "the stock market fell"]
    )
    vectors = [d.embedding for d in out.data]
    assert len(vectors) == 2 and len(vectors[0]) == 384
    norm = sum(x * x for x in vectors[0]) ** 0.5
    assert abs(norm - 1.0) < 1e-3  # normalized, as the folder's sentence-transformers config says
    assert out.usage.prompt_tokens > 0
    # what they say: sentence-transformers' own vectors of the same texts, from the same folder
    from sentence_transformers import SentenceTransformer

    texts = ["a cat sat on the mat", "the stock market fell"]
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts)
    for vector, reference in zip(vectors, expected, strict=True):
        assert max(abs(a - float(b)) for a, b in zip(vector, reference, strict=True)) < 1e-4


def test_model_converges_through_an_etcd_stall_and_an_api_server_restart(stack):
    """Mid-rollout of 3 replicas, etcd freezes for 25 s, then the API server is killed and comes back 3 s
    later. The pod runner re-lists as a kubelet does (its loop died on the first refused connection before),
    the operator re-watches, and the model converges with nothing done twice: 3 pods started in all, status
    current. A 25 s stall outlasts the operator's 15 s Lease, so the leader may step down the way client-go's
    leader election does (exit 3, restarted as a standby); it never crashes (its renew thread died on the
    first refused connection before, and a standby exited with a traceback)."""
    manifest = model_manifest(3, SHAPES_A)
    manifest["metadata"]["name"] = "chaos"
    manifest["spec"]["model"]["servedModelName"] = "chaos"

    def chaos_pods() -> list[tuple[str, str, str]]:
        return [a for a in stack.runner.admitted if a[0] == NS and a[1].startswith("chaos-")]

    def operator_pods():
        return [rp for rp in stack.runner.pods.values() if rp.namespace == "spyre-system"]

    restarts_before = {rp.name: rp.restarts for rp in operator_pods()}
    failed_before = stack.runner.failed_passes
    stack.apply_model(NS, manifest)
    stack.wait(lambda: chaos_pods(), 60, "the first chaos pod to start")
    assert not stack.is_ready(NS, "chaos", 3)  # the chaos comes mid-rollout
    stack.cp.pause("etcd")
    try:
        time.sleep(25)
    finally:
        stack.cp.resume("etcd")
    stack.cp.restart_apiserver(down_seconds=3)
    stack.wait(
        lambda: stack.is_ready(NS, "chaos", 3),
        300,
        "chaos: 3 replicas Ready",
        lambda: stack.diagnose(NS, "chaos"),
    )
    assert stack.runner.is_alive(), stack.runner.last_error
    assert stack.runner.failed_passes > failed_before  # it did meet the outage, and came through it
    started = chaos_pods()
    assert len(started) == 3 and len({uid for *_, uid in started}) == 3, started
    for rp in operator_pods():
        if rp.restarts > restarts_before.get(rp.name, 0):
            assert rp.last_exit["exitCode"] == 3, rp.last_exit  # stepped down: lost the Lease
        log = rp.log.read_text(errors="replace")
        assert "Exception in thread" not in log and "Traceback" not in log, log[-3000:]
    status = stack.model(NS, "chaos")
    assert status["status"]["observedGeneration"] == status["metadata"]["generation"]
    ip = stack.wait(lambda: stack.endpoints(NS, "chaos"), 30, "a ready chaos endpoint")[0]
    c = openai_client(f"http://{ip}:8000/v1", timeout=30)
    answer = c.completions.create(model="chaos", prompt="Hi", max_tokens=2, temperature=0).choices[0].text
    assert answer == hf_greedy_text(stack.tiny_dir, "Hi", 2)
