"""Serving the completion routes of decoder models (router.py): OpenAI's `/v1/completions` and
`/v1/chat/completions`.

A request is checked (validator.Validator; a chat request in one pass, chat_request.check_chat), turned
into token ids (chat/prompts), submitted to the engine as one sequence per prompt and choice
(GenerateState.submit), then answered whole (formatting.build_response) or streamed
(formatting.stream_events). A client that hangs up (streaming or not) has its requests aborted
at once: their slots are free by the next engine step."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from spyre_runtime.entrypoints.chat.chat_output import OutputParser
from spyre_runtime.entrypoints.chat.prompts import tokenize
from spyre_runtime.entrypoints.completions.beam import beam_respond, check_beam
from spyre_runtime.entrypoints.completions.chat_request import check_chat
from spyre_runtime.entrypoints.completions.formatting import Reply, build_response, stream_events
from spyre_runtime.entrypoints.completions.protocol import ChatCompletionRequest, CompletionRequest
from spyre_runtime.entrypoints.completions.state import GenerateState, generate_state
from spyre_runtime.entrypoints.completions.submission import collect
from spyre_runtime.entrypoints.completions.validator import Choice
from spyre_runtime.entrypoints.server.errors import APIError, bad_request
from spyre_runtime.request import ImageInput


async def create_completion(body: CompletionRequest, request: Request):
    state = generate_state(request)
    v = state.ready_validator()
    v.model(body.model)
    prompts = v.prompt_shape(body)
    v.num_sequences(len(prompts), body)
    add_special = body.add_special_tokens is not False
    tokenizer = state.client.tokenizer
    ids = [tokenize(tokenizer, p, add_special) if isinstance(p, str) else list(p) for p in prompts]
    if body.echo and body.stream:
        raise bad_request("echo", "echo is not supported with stream")
    beams = check_beam(body, state.config.use_cb, len(state.client.eos_ids))
    choices: list[Choice] = []
    limits = []
    for i, prompt_ids in enumerate(ids):
        if not prompt_ids:
            raise bad_request("prompt", "the prompt is empty")
        v.token_ids(prompt_ids, "prompt")
        params = v.sampling(body, len(prompt_ids), chat=False)
        limits.append(params.max_tokens)
        if beams is None:
            for c in v.choices(body, params, i):
                choices.append(Choice(len(choices), i, c.params))
    if beams is not None:
        return await beam_respond(state, request, body, ids, beams, limits)
    return await respond(state, request, body, ids, choices, chat=False)


async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    state = generate_state(request)
    chat = await check_chat(state, body, request.app.state.chat)  # every check, in one pass
    if chat.beams is not None:
        limits = [chat.params.max_tokens]
        return await beam_respond(state, request, body, [chat.prompt], chat.beams, limits, chat.output)
    return await respond(
        state, request, body, [chat.prompt], chat.choices, chat=True, output=chat.output, images=chat.images
    )


async def respond(
    state: GenerateState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    choices: list[Choice],
    chat: bool,
    output: OutputParser | None = None,
    images: ImageInput | None = None,
):
    """Submits the request's sequences and answers: a stream of events, or the whole body at the end."""
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    sub = state.submit(rid, choices, prompts, images, request.headers)
    model = state.config.served_model_name
    reply = Reply(sub, body, int(time.time()), model, chat, state.token_text, output or OutputParser())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream_events(reply, include_usage), media_type="text/event-stream")
    try:
        finals = await collect(request, sub)
    finally:
        sub.close()
    if finals is None:  # the client went away: nobody reads an answer
        return Response(status_code=499)
    failed = next((o for o in finals.values() if o.finish_reason == "error"), None)
    if failed is not None:
        raise APIError(500, f"the request failed: {failed.error}", code="request_failed")
    return build_response(reply, finals)
