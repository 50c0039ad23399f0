"""The routes every server has, whatever its task: `/health` (the kubelet's and the operator's probe),
`/metrics` (Prometheus), `/version`, and OpenAI's `/v1/models`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from spyre_runtime.entrypoints.errors import APIError
from spyre_runtime.entrypoints.state import runtime_version, serving_state

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    status, body = serving_state(request).health()
    return body if status == 200 else JSONResponse(body, status_code=status)


@router.get("/metrics")
async def metrics(request: Request):
    state = serving_state(request)
    state.observe_warming()
    state.observe_load()
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version_():
    return {"version": runtime_version()}


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [serving_state(request).model_card()]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    state = serving_state(request)
    if model_id != state.config.served_model_name:
        raise APIError(404, f"model {model_id!r} does not exist", "model", "model_not_found")
    return state.model_card()
