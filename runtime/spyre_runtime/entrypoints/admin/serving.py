"""Serving the routes every server has (router.py): its health, its metrics, and its model card."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from spyre_runtime.entrypoints.server.errors import APIError
from spyre_runtime.entrypoints.server.state import ServingState


def health_response(state: ServingState):
    """/health: 200 when ready, else 503 with what the server is doing."""
    status, body = state.health()
    return body if status == 200 else JSONResponse(body, status_code=status)


def metrics_response(state: ServingState) -> Response:
    """The registry in Prometheus's text format, its gauges brought up to date first."""
    state.observe_warming()
    state.observe_load()
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def model_card(state: ServingState, model_id: str) -> dict:
    if model_id != state.config.served_model_name:
        raise APIError(404, f"model {model_id!r} does not exist", "model", "model_not_found")
    return state.model_card()
