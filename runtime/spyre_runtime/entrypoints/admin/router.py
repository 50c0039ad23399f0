"""The routes every server has, whatever its task: `/health` (the kubelet's and the operator's probe),
`/metrics` (Prometheus), `/version`, and OpenAI's `/v1/models`; serving.py answers them."""

from __future__ import annotations

from fastapi import APIRouter, Request

from spyre_runtime.entrypoints.admin.serving import health_response, metrics_response, model_card
from spyre_runtime.entrypoints.server.state import runtime_version, serving_state

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    return health_response(serving_state(request))


@router.get("/metrics")
async def metrics(request: Request):
    return metrics_response(serving_state(request))


@router.get("/version")
async def version_():
    return {"version": runtime_version()}


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [serving_state(request).model_card()]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    return model_card(serving_state(request), model_id)
