"""OpenAI's Responses API routes; serving.py answers them."""

from __future__ import annotations

from fastapi import APIRouter, Request

from spyre_runtime.entrypoints.responses.protocol import ResponsesRequest
from spyre_runtime.entrypoints.responses.serving import create_response, delete_stored, stored_response

router = APIRouter()


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    return await create_response(body, request)


@router.get("/v1/responses/{rid}")
async def get_response(rid: str, request: Request):
    return stored_response(request, rid)


@router.delete("/v1/responses/{rid}")
async def delete_response(rid: str, request: Request):
    return delete_stored(request, rid)
