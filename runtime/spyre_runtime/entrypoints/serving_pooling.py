"""The routes of pooling models: OpenAI's `/v1/embeddings`, vLLM's `/score` (also `/v1/score`), and
`/rerank` (also `/v1/rerank`, `/v2/rerank`) in vLLM's / Jina's / Cohere's format.

Embedding models serve all of them (score and rerank by cosine similarity of the embeddings, as vLLM);
cross-encoders serve score and rerank. Every input is checked here (Inputs): an input longer than every
warm-up shape is a 400 naming the shapes unless the request asks for `truncate_prompt_tokens`."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid

import torch
from fastapi import APIRouter, Request

from spyre_runtime.entrypoints.errors import APIError, bad_request
from spyre_runtime.entrypoints.pooling_protocol import (
    MAX_INPUTS,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from spyre_runtime.entrypoints.pooling_state import PoolingState, pooling_state
from spyre_runtime.executor.families.pooling import shapes_str

router = APIRouter()


class Inputs:
    """Tokenizes and checks the inputs of one request against the warm-up shapes."""

    def __init__(self, state: PoolingState, truncate: int | None) -> None:
        self.state = state
        self.max_len = state.scheduler.max_len
        if truncate == -1:
            truncate = self.max_len
        if truncate is not None and not 1 <= truncate <= self.max_len:
            raise bad_request(
                "truncate_prompt_tokens",
                f"{truncate} must be -1 or between 1 and {self.max_len}, the longest warm-up prompt length",
            )
        self.truncate = truncate

    def texts(self, texts: list[str], param: str, add_special_tokens: bool = True) -> list[tuple]:
        return self._encode(texts, None, param, add_special_tokens)

    def pairs(self, firsts: list[str], seconds: list[str], param: str) -> list[tuple]:
        return self._encode(firsts, seconds, param, True)

    def _encode(self, firsts, seconds, param: str, add_special_tokens: bool) -> list[tuple]:
        kwargs = {"add_special_tokens": add_special_tokens}
        if self.truncate is not None:
            kwargs |= {"truncation": True, "max_length": self.truncate}
        try:
            enc = self.state.tokenizer(firsts, seconds, **kwargs)
        except Exception as e:  # e.g. lone surrogates, which JSON allows and UTF-8 does not
            raise bad_request(param, f"could not be tokenized: {e}") from None
        types = enc.get("token_type_ids") if self.state.spec.family == "bert" else None
        rows = [(ids, types[i] if types else None) for i, ids in enumerate(enc["input_ids"])]
        for i, (ids, _) in enumerate(rows):
            self._check_length(len(ids), f"{param}[{i}]" if len(rows) > 1 else param)
        return rows

    def token_ids(self, lists: list[list[int]], param: str) -> list[tuple]:
        vocab = len(self.state.tokenizer)
        rows = []
        for i, ids in enumerate(lists):
            where = f"{param}[{i}]" if len(lists) > 1 else param
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(where, f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
            if self.truncate is not None:
                ids = ids[-self.truncate :]
            self._check_length(len(ids), where)
            rows.append((list(ids), None))
        return rows

    def _check_length(self, n: int, where: str) -> None:
        if n == 0:
            raise bad_request(where, "is empty")
        if n > self.max_len:
            raise bad_request(
                where,
                f"{n} tokens fit no warm-up shape [{shapes_str(self.state.config.shapes)}]; shorten it "
                f"or set truncate_prompt_tokens (at most {self.max_len})",
            )


# ---- routes ----------------------------------------------------------------------------------------


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    state = pooling_state(request)
    with state.admitted(body.model):
        return await embed(state, body)


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request):
    state = pooling_state(request)
    with state.admitted(body.model):
        return await score_texts(state, body)


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request):
    state = pooling_state(request)
    with state.admitted(body.model):
        return await rerank_documents(state, body)


# ---- serving them ----------------------------------------------------------------------------------


async def embed(state: PoolingState, body: EmbeddingRequest) -> dict:
    inputs = Inputs(state, body.truncate_prompt_tokens)
    if state.spec.is_cross_encoder:
        raise APIError(
            400, "this model is a cross-encoder: it serves /score and /rerank, not embeddings", "model"
        )
    dim = state.spec.hidden_size
    if body.dimensions is not None and body.dimensions != dim:
        raise bad_request(
            "dimensions",
            f"this model returns {dim}-dimensional embeddings and cannot shorten them "
            f"(not a Matryoshka model); omit dimensions or set it to {dim}",
        )
    raw = body.input
    if isinstance(raw, list) and not raw:
        raise bad_request("input", "must not be empty")
    if isinstance(raw, list) and len(raw) > MAX_INPUTS and not isinstance(raw[0], int):
        raise bad_request("input", f"at most {MAX_INPUTS} inputs in one request")
    add_special = True if body.add_special_tokens is None else body.add_special_tokens
    if isinstance(raw, str):
        rows = await asyncio.to_thread(inputs.texts, [raw], "input", add_special)
    elif isinstance(raw[0], str):
        rows = await asyncio.to_thread(inputs.texts, raw, "input", add_special)
    elif isinstance(raw[0], int):
        rows = inputs.token_ids([raw], "input")
    else:
        rows = inputs.token_ids(raw, "input")
    vectors = await state.run(rows)
    tokens = _count_pooled(state, rows)
    as_base64 = body.encoding_format == "base64"
    data = [
        {"object": "embedding", "index": i, "embedding": _base64(v) if as_base64 else v.tolist()}
        for i, v in enumerate(vectors)
    ]
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": state.config.served_model_name,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def score_texts(state: PoolingState, body: ScoreRequest) -> dict:
    inputs = Inputs(state, body.truncate_prompt_tokens)
    t1 = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    t2 = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not t1 or not t2:
        raise bad_request("text_1" if not t1 else "text_2", "must not be empty")
    if len(t1) == 1:
        t1 = t1 * len(t2)
    if len(t1) != len(t2):
        raise bad_request(
            "text_2",
            f"text_1 has {len(t1)} texts and text_2 {len(t2)}: give one text_1, or as many as text_2",
        )
    if len(t2) > MAX_INPUTS:
        raise bad_request("text_2", f"at most {MAX_INPUTS} pairs in one request")
    scores, rows = await score_pairs(state, inputs, t1, t2, ("text_1", "text_2"))
    tokens = _count_pooled(state, rows)
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": state.config.served_model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def rerank_documents(state: PoolingState, body: RerankRequest) -> dict:
    inputs = Inputs(state, body.truncate_prompt_tokens)
    docs = [d if isinstance(d, str) else d.text for d in body.documents]
    if not docs:
        raise bad_request("documents", "must not be empty")
    if len(docs) > MAX_INPUTS:
        raise bad_request("documents", f"at most {MAX_INPUTS} documents in one request")
    scores, rows = await score_pairs(state, inputs, [body.query] * len(docs), docs, ("query", "documents"))
    tokens = _count_pooled(state, rows)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[: body.top_n]
    with_docs = body.return_documents is not False
    results = [
        {"index": i, "relevance_score": scores[i], **({"document": {"text": docs[i]}} if with_docs else {})}
        for i in order
    ]
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": state.config.served_model_name,
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def score_pairs(
    state: PoolingState, inputs: Inputs, firsts: list[str], seconds: list[str], params: tuple[str, str]
) -> tuple[list[float], list[tuple]]:
    """-> (scores of (firsts[i], seconds[i]), the rows run)."""
    if state.spec.is_cross_encoder:
        rows = await asyncio.to_thread(inputs.pairs, firsts, seconds, params[1])
        return [float(s) for s in await state.run(rows)], rows
    unique = list(dict.fromkeys(firsts))  # rerank: one query for every document
    rows = await asyncio.to_thread(inputs.texts, unique, params[0])
    rows += await asyncio.to_thread(inputs.texts, seconds, params[1])
    vectors = await state.run(rows)
    query = dict(zip(unique, vectors, strict=False))
    pairs = zip(firsts, vectors[len(unique) :], strict=True)
    return [_cosine(query[a], b) for a, b in pairs], rows


def _count_pooled(state: PoolingState, rows: list[tuple]) -> int:
    """Counts a pooled request in the metrics; -> its tokens."""
    tokens = sum(len(ids) for ids, _ in rows)
    state.metrics.requests.labels("pooled").inc()
    state.metrics.prompt_tokens.inc(tokens)
    return tokens


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def _base64(vector: torch.Tensor) -> str:
    """OpenAI's base64 encoding: the float32 little-endian bytes."""
    return base64.b64encode(vector.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()).decode()
