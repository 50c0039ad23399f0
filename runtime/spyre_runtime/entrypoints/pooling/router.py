"""The routes of pooling models (embed, score, rerank); serving.py answers them."""

from __future__ import annotations

from fastapi import APIRouter, Request

from spyre_runtime.entrypoints.pooling.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from spyre_runtime.entrypoints.pooling.serving import embed, rerank_documents, score_texts
from spyre_runtime.entrypoints.pooling.state import pooling_state

router = APIRouter()


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
