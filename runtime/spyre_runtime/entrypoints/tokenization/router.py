"""The tokenizer routes of decoder models (vLLM's); serving.py answers them."""

from __future__ import annotations

from fastapi import APIRouter, Request

from spyre_runtime.entrypoints.tokenization.protocol import DetokenizeRequest, TokenizeRequest
from spyre_runtime.entrypoints.tokenization.serving import detokenize_request, tokenize_request

router = APIRouter()


@router.post("/tokenize")
async def tokenize_endpoint(body: TokenizeRequest, request: Request):
    return await tokenize_request(body, request)


@router.post("/detokenize")
async def detokenize_endpoint(body: DetokenizeRequest, request: Request):
    return await detokenize_request(body, request)
