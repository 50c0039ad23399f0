"""Serving the tokenizer routes of decoder models (vLLM's, router.py): `/tokenize` (a prompt, or chat
messages through the chat template) and `/detokenize`."""

from __future__ import annotations

from fastapi import Request

from spyre_runtime.entrypoints.chat.prompts import render_chat, tokenize
from spyre_runtime.entrypoints.completions.state import generate_state
from spyre_runtime.entrypoints.server.errors import bad_request
from spyre_runtime.entrypoints.tokenization.protocol import DetokenizeRequest, TokenizeRequest


async def tokenize_request(body: TokenizeRequest, request: Request) -> dict:
    state = generate_state(request)
    v = state.ready_validator()
    v.model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("prompt", "give exactly one of prompt and messages")
    tokenizer = state.client.tokenizer
    if body.prompt is not None:
        ids = tokenize(tokenizer, body.prompt, body.add_special_tokens is not False)
    else:
        ids = tokenize(tokenizer, render_chat(tokenizer, body), bool(body.add_special_tokens), "messages")
    result = {"count": len(ids), "max_model_len": state.config.max_model_len, "tokens": ids}
    if body.return_token_strs:
        result["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return result


async def detokenize_request(body: DetokenizeRequest, request: Request) -> dict:
    state = generate_state(request)
    v = state.ready_validator()
    v.model(body.model)
    v.token_ids(body.tokens, "tokens")
    return {"prompt": state.client.tokenizer.decode(body.tokens)}
