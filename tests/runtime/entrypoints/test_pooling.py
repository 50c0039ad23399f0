"""The pooling server end to end: `spyre-runtime serve` on all-MiniLM-L6-v2 and on a tiny cross-encoder
(one server process each for the whole module), through the official openai client and plain HTTP.
Embeddings must equal sentence-transformers' and scores HF's forward (tolerance 1e-5, test_pooling.py)."""

from __future__ import annotations

import base64
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from spyre_runtime.testing.models import prepare_minilm, write_tiny_cross_encoder

from tests.httpclient import HTTP
from tests.runtime.serverproc import ServerProcess

TOLERANCE = 1e-5
SHAPES_ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
    "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64,128,256",
    "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "8,4,1",
    "HF_HUB_OFFLINE": "1",
}
TEXTS = [
    "The capital of France is Paris.",
    "Bananas are yellow and rich in potassium.",
    "Kubernetes reconciles custom resources into pods.",
    "hello",
]
QUERY = "what is the capital of france"


@pytest.fixture(scope="module")
def minilm() -> Path:
    return prepare_minilm(Path.home() / ".cache/spyre-serve/models/minilm")


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> Path:
    return write_tiny_cross_encoder(tmp_path_factory.mktemp("ce"), "bert", seed=3)


@pytest.fixture(scope="module")
def embed_server(minilm, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "minilm.log"
    with ServerProcess(minilm, SHAPES_ENV, log, served_name="minilm").serving(timeout=300) as server:
        yield server


@pytest.fixture(scope="module")
def rerank_server(cross_encoder, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "ce.log"
    env = {
        **SHAPES_ENV,
        "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64,256",
        "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "4,2",
    }
    with ServerProcess(
        cross_encoder, env, log, served_name="ce", extra_args=("--task", "rerank")
    ).serving() as s:
        yield s


@pytest.fixture(scope="module")
def st(minilm):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm), device="cpu")


@pytest.fixture(scope="module")
def tokenizer(minilm):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm)


def post(server, path: str, body: dict) -> httpx.Response:
    return HTTP.post(server.base + path, json=body, timeout=60)


def assert_error(response: httpx.Response, status: int, param: str | None, fragment: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


# ---- /v1/embeddings -------------------------------------------------------------------------------


def test_openai_client_embeddings_equal_sentence_transformers(embed_server, st, tokenizer):
    client = embed_server.client()
    result = client.embeddings.create(model="minilm", input=TEXTS)  # the client asks for base64
    ours = torch.tensor([d.embedding for d in result.data])
    assert [d.index for d in result.data] == list(range(len(TEXTS)))
    expected = st.encode(TEXTS, convert_to_tensor=True)
    assert (ours - expected).abs().max().item() < TOLERANCE
    tokens = sum(len(ids) for ids in tokenizer(TEXTS)["input_ids"])
    assert result.usage.prompt_tokens == tokens and result.usage.total_tokens == tokens
    assert result.model == "minilm"


def test_float_and_base64_encodings_agree(embed_server):
    floats = post(embed_server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "float"}).json()
    b64 = post(embed_server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"}).json()
    vector = floats["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert len(vector) == 384 and decoded.shape == (384,)
    assert np.allclose(decoded, np.array(vector, dtype=np.float32), atol=0, rtol=0)
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"


def test_token_id_inputs_equal_text_inputs(embed_server, tokenizer):
    client = embed_server.client()
    ids = tokenizer(TEXTS[:2])["input_ids"]
    from_text = client.embeddings.create(model="minilm", input=TEXTS[:2], encoding_format="float")
    from_ids = client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    one = client.embeddings.create(model="minilm", input=ids[1], encoding_format="float")
    for a, b in zip(from_text.data, from_ids.data, strict=True):
        assert np.allclose(a.embedding, b.embedding, atol=1e-6)
    assert np.allclose(one.data[0].embedding, from_text.data[1].embedding, atol=1e-6)
    assert from_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_dimensions_other_than_the_models_are_refused(embed_server):
    client = embed_server.client()
    assert len(client.embeddings.create(model="minilm", input="x", dimensions=384).data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="minilm", input="x", dimensions=128)
    assert e.value.body["param"] == "dimensions"
    assert "384-dimensional" in e.value.body["message"] and "Matryoshka" in e.value.body["message"]


def test_an_input_longer_than_every_shape_is_refused_or_truncated(embed_server, tokenizer):
    long_text = "kubernetes operators reconcile resources " * 80
    response = post(embed_server, "/v1/embeddings", {"input": ["short", long_text]})
    assert_error(response, 400, "input[1]", "tokens fit no warm-up shape")
    message = response.json()["error"]["message"]
    for shape in (
        "(prompt_len=64, batch_size=8)",
        "(prompt_len=128, batch_size=4)",
        "(prompt_len=256, batch_size=1)",
    ):
        assert shape in message
    assert "truncate_prompt_tokens" in message
    truncated = post(
        embed_server, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": 100}
    ).json()
    assert truncated["usage"]["prompt_tokens"] == 100
    expected_ids = tokenizer(long_text, truncation=True, max_length=100)["input_ids"]
    same = post(embed_server, "/v1/embeddings", {"input": expected_ids, "encoding_format": "float"}).json()
    assert np.allclose(same["data"][0]["embedding"], truncated["data"][0]["embedding"], atol=1e-6)
    whole = post(embed_server, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == 256
    assert_error(
        post(embed_server, "/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 1000}),
        400,
        "truncate_prompt_tokens",
        "between 1 and 256",
    )


@pytest.mark.parametrize(
    ("body", "status", "param", "fragment"),
    [
        ({"input": []}, 400, "input", "must not be empty"),
        ({"input": [[]]}, 400, "input", "is empty"),
        ({"input": [5, 999999]}, 400, "input", "token id 999999 is outside the vocabulary"),
        ({"input": 3}, 400, "input", "input"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format", "encoding_format"),
        ({"input": "x", "temperature": 0.5}, 400, "temperature", "unknown parameter"),
        ({"input": "x", "model": "gpt-4"}, 404, "model", "'gpt-4' does not exist"),
        ({}, 400, "input", "required"),
    ],
)
def test_bad_embedding_requests_name_the_parameter(embed_server, body, status, param, fragment):
    assert_error(post(embed_server, "/v1/embeddings", body), status, param, fragment)


def test_concurrent_requests_are_batched_together(embed_server, st):
    def steps() -> float:
        text = HTTP.get(embed_server.base + "/metrics").text
        match = re.search(r'spyre_engine_step_seconds_count\{kind="pool"\} ([0-9.e+]+)', text)
        return float(match.group(1)) if match else 0.0

    before = steps()
    results: dict[int, list[float]] = {}

    def one(i: int) -> None:
        data = post(
            embed_server, "/v1/embeddings", {"input": TEXTS[i % 4], "encoding_format": "float"}
        ).json()
        results[i] = data["data"][0]["embedding"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    expected = st.encode(TEXTS, convert_to_tensor=True)
    assert len(results) == 16
    for i, vector in results.items():
        assert (torch.tensor(vector) - expected[i % 4]).abs().max().item() < TOLERANCE
    assert steps() - before < 16  # inputs of different requests shared steps


def test_health_models_and_metrics(embed_server):
    assert HTTP.get(embed_server.base + "/health").json() == {"status": "ok"}
    card = HTTP.get(embed_server.base + "/v1/models").json()["data"][0]
    assert (card["id"], card["max_model_len"], card["task"]) == ("minilm", 256, "embed")
    assert HTTP.get(embed_server.base + "/v1/models/nope").status_code == 404
    assert post(embed_server, "/v1/embeddings", {"input": "x"}).status_code == 200
    metrics = HTTP.get(embed_server.base + "/metrics").text
    assert 'spyre_requests_total{outcome="pooled"}' in metrics and "spyre_warmup_seconds" in metrics
    assert "spyre_warmup_graphs 3.0" in metrics and "spyre_warmup_graphs_done 3.0" in metrics
    assert 503 in embed_server.health_codes  # not ready while the shapes warmed up


def test_embedding_models_score_and_rerank_by_cosine_similarity(embed_server, st):
    docs = TEXTS[:3]
    scores = post(embed_server, "/score", {"text_1": QUERY, "text_2": docs}).json()
    vectors = st.encode([QUERY, *docs], convert_to_tensor=True)
    expected = torch.nn.functional.cosine_similarity(vectors[:1], vectors[1:])
    ours = torch.tensor([d["score"] for d in scores["data"]])
    assert (ours - expected).abs().max().item() < TOLERANCE
    ranked = post(embed_server, "/rerank", {"query": QUERY, "documents": docs}).json()
    assert ranked["results"][0]["index"] == 0 and ranked["results"][0]["document"]["text"] == docs[0]


# ---- cross-encoders: /score and /rerank ----------------------------------------------------------


@pytest.fixture(scope="module")
def hf_scores(cross_encoder):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cross_encoder)
    model = AutoModelForSequenceClassification.from_pretrained(cross_encoder).eval()
    docs = [t.lower() for t in TEXTS]
    batch = tok([QUERY] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        return docs, torch.sigmoid(model(**batch).logits[:, 0])


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_as_hf(rerank_server, hf_scores, path):
    docs, expected = hf_scores
    body = {"model": "ce", "query": QUERY, "documents": [docs[0], {"text": docs[1]}, *docs[2:]]}
    result = post(rerank_server, path, body).json()
    order = torch.argsort(expected, descending=True).tolist()
    assert [r["index"] for r in result["results"]] == order
    for r in result["results"]:
        assert abs(r["relevance_score"] - expected[r["index"]].item()) < TOLERANCE
        assert r["document"]["text"] == docs[r["index"]]
    assert result["model"] == "ce" and result["usage"]["total_tokens"] > len(docs) * 4


def test_rerank_top_n_and_return_documents(rerank_server, hf_scores):
    docs, expected = hf_scores
    result = post(
        rerank_server, "/rerank", {"query": QUERY, "documents": docs, "top_n": 2, "return_documents": False}
    )
    results = result.json()["results"]
    assert [r["index"] for r in results] == torch.argsort(expected, descending=True).tolist()[:2]
    assert all("document" not in r for r in results)


def test_score_pairs_one_to_many_and_many_to_many(rerank_server, hf_scores):
    docs, expected = hf_scores
    one_to_many = post(rerank_server, "/score", {"text_1": QUERY, "text_2": docs}).json()
    assert [d["index"] for d in one_to_many["data"]] == list(range(len(docs)))
    ours = torch.tensor([d["score"] for d in one_to_many["data"]])
    assert (ours - expected).abs().max().item() < TOLERANCE
    many = post(rerank_server, "/score", {"text_1": [QUERY] * 2, "text_2": docs[:2]}).json()
    assert torch.allclose(torch.tensor([d["score"] for d in many["data"]]), expected[:2], atol=TOLERANCE)


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "give one text_1"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2", "must not be empty"),
        ("/score", {"text_1": "a"}, "text_2", "required"),
        ("/rerank", {"query": "a", "documents": []}, "documents", "must not be empty"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", "top_n"),
        ("/rerank", {"query": "a " * 300, "documents": ["b"]}, "documents", "fit no warm-up shape"),
        ("/v1/embeddings", {"input": "a"}, "model", "cross-encoder"),
    ],
)
def test_bad_score_requests_name_the_parameter(rerank_server, path, body, param, fragment):
    assert_error(post(rerank_server, path, body), 400, param, fragment)


def test_truncation_lets_long_pairs_through(rerank_server):
    result = post(
        rerank_server, "/rerank", {"query": "a " * 300, "documents": ["b", "c"], "truncate_prompt_tokens": 64}
    )
    assert result.status_code == 200 and len(result.json()["results"]) == 2
    assert result.json()["usage"]["total_tokens"] == 128


# ---- the server's life: SIGTERM drains, as a decoder's ----------------------------------------------


def test_sigterm_drains_in_flight_pooling_requests_then_exits_0(minilm, tmp_path):
    """Requests in flight when SIGTERM lands are answered (200, every embedding); a request arriving during
    the drain gets the decoder's 503 and /health says draining; then the process exits 0."""
    env = {
        **SHAPES_ENV,
        "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "256",
        "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "1",
    }
    srv = ServerProcess(minilm, env, tmp_path / "s.log", served_name="minilm")
    num_requests, num_inputs = 3, 20  # one input a step: 60 steps of ~50 ms, seconds in flight
    long_text = "kubernetes operators reconcile resources " * 80
    body = {"input": [long_text] * num_inputs, "truncate_prompt_tokens": -1, "encoding_format": "float"}
    answers: dict[int, tuple[httpx.Response, float]] = {}

    def embed(i: int) -> None:
        response = HTTP.post(srv.base + "/v1/embeddings", json=body, timeout=120)
        answers[i] = (response, time.monotonic())

    try:
        srv.wait_ready()
        threads = [threading.Thread(target=embed, args=(i,)) for i in range(num_requests)]
        for t in threads:
            t.start()
        wait_until_submitted(srv, num_requests * num_inputs)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        late = post(srv, "/v1/embeddings", {"input": "late"})
        refused_at = time.monotonic()
        health = HTTP.get(srv.base + "/health", timeout=10)
        for t in threads:
            t.join(timeout=120)
        assert_error(late, 503, None, "the server is not ready (warming up or shutting down)")
        assert late.json()["error"]["type"] == "service_unavailable"
        assert (health.status_code, health.json()) == (503, {"status": "draining"})
        assert sorted(answers) == list(range(num_requests))
        for response, finished_at in answers.values():
            assert response.status_code == 200, response.text
            assert len(response.json()["data"]) == num_inputs
            assert response.json()["usage"]["prompt_tokens"] == num_inputs * 256
            assert finished_at > refused_at  # still in flight when the late request was refused
        assert srv.proc.wait(timeout=60) == 0
        assert "SIGTERM: draining" in srv.log()
    finally:
        srv.stop()


def wait_until_submitted(srv: ServerProcess, num_items: int, timeout: float = 60) -> None:
    """Until every input has reached the engine: those waiting plus the steps run (one input each) count
    them all (but the one running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = HTTP.get(srv.base + "/metrics", timeout=10).text
        waiting = re.search(r"^spyre_queue_length ([0-9.e+]+)$", text, re.M)
        steps = re.search(r'^spyre_engine_step_seconds_count\{kind="pool"\} ([0-9.e+]+)$', text, re.M)
        done = float(steps.group(1)) if steps else 0.0
        if waiting and float(waiting.group(1)) + done >= num_items - 1:
            assert float(waiting.group(1)) > 0, "the requests finished before the SIGTERM"
            return
        time.sleep(0.02)
    raise AssertionError(f"the requests did not reach the engine in {timeout} s:\n{srv.log()}")
