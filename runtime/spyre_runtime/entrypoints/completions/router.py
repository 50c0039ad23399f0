"""OpenAI's completion routes of decoder models; serving.py answers them."""

from __future__ import annotations

from fastapi import APIRouter, Request

from spyre_runtime.entrypoints.completions.protocol import ChatCompletionRequest, CompletionRequest
from spyre_runtime.entrypoints.completions.serving import create_chat_completion, create_completion

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await create_completion(body, request)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await create_chat_completion(body, request)
