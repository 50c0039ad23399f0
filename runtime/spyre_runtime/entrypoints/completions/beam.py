"""Beam search on /v1/completions and /v1/chat/completions, vLLM's parameters: `use_beam_search`, `n`
beams, `length_penalty`, `early_stopping`. As vLLM v1 runs it: each step's beams are requests of one token
(with their top logprobs) on the continuous-batching scheduler, so the prefix cache shares the prompt's
full KV blocks (and those of the beams' common prefix) among the beams by reference counts, and nothing is
copied; sampling.beam_search.BeamSearch decides each step as HF transformers does. The n beams come back
as n choices, best first; beam search neither streams nor combines with sampling or output constraints."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from spyre_runtime.engine.outputs import decode_output
from spyre_runtime.entrypoints.chat.chat_output import OutputParser
from spyre_runtime.entrypoints.completions.formatting import chat_message, finish_reason, usage
from spyre_runtime.entrypoints.completions.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from spyre_runtime.entrypoints.completions.state import GenerateState
from spyre_runtime.entrypoints.completions.submission import collect
from spyre_runtime.entrypoints.completions.validator import Choice
from spyre_runtime.entrypoints.server.errors import APIError, bad_request
from spyre_runtime.sampling.beam_search import BeamSearch, Hypothesis
from spyre_runtime.sampling.params import MAX_LOGPROBS, SamplingParams

# parameters that would change what a beam is (sampling, penalties, stops, constraints) or that beam
# search cannot give (streams, logprobs): refused with use_beam_search
NOT_WITH_BEAMS = (
    "stream",
    "echo",
    "logprobs",
    "top_logprobs",
    "best_of",
    "top_k",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
)


@dataclass(frozen=True)
class BeamSettings:
    width: int
    length_penalty: float
    early_stopping: bool | str


def check_beam(body: SamplingFields, use_cb: bool, num_eos: int) -> BeamSettings | None:
    """The request's beam search, checked; None when it asks for none."""
    if not body.use_beam_search:
        for name in ("length_penalty", "early_stopping"):
            if getattr(body, name) is not None:
                raise bad_request(name, "applies to beam search (use_beam_search: true)")
        return None
    if not use_cb:
        raise bad_request(
            "use_beam_search",
            "beam search is not supported with static batching: it runs on continuous batching "
            "(a decoder's default; SENDNN_INFERENCE_USE_CB=1)",
        )
    for name in NOT_WITH_BEAMS:
        if getattr(body, name, None) not in (None, False):
            raise bad_request(name, "cannot be combined with use_beam_search")
    if body.temperature:
        raise bad_request("temperature", "beam search is deterministic: leave temperature unset or 0")
    if isinstance(body, ChatCompletionRequest) and body.tool_choice not in (None, "auto", "none"):
        raise bad_request("tool_choice", "cannot be combined with use_beam_search")
    width = body.n or 1
    per_beam = max(2, 1 + num_eos)
    if width * per_beam > MAX_LOGPROBS:
        raise bad_request("n", f"beam search takes at most {MAX_LOGPROBS // per_beam} beams, got {width}")
    lp = 1.0 if body.length_penalty is None else body.length_penalty
    return BeamSettings(width, lp, False if body.early_stopping is None else body.early_stopping)


async def search(
    state: GenerateState, request: Request, rid: str, prompt: list[int], beams: BeamSettings, max_tokens: int
) -> BeamSearch | None:
    """One prompt's beam search, step by step on the engine; None when the client went away."""
    eos = state.client.eos_ids
    bs = BeamSearch(beams.width, max_tokens, eos, beams.length_penalty, beams.early_stopping)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=bs.num_candidates)
    while not bs.done:
        prompts = [prompt + list(beam.tokens) for beam in bs.running]
        sub = state.submit(
            f"{rid}-{bs.num_generated}",
            [Choice(i, i, params) for i in range(len(prompts))],
            prompts,
            headers=request.headers,
        )
        try:
            finals = await collect(request, sub)
        finally:
            sub.close()
        if finals is None:
            return None
        outs = [finals[eid] for eid in sub.engine_ids]
        failed = next((o for o in outs if o.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(500, f"the request failed: {failed.error}", code="request_failed")
        bs.advance([list(o.logprobs[0].top) for o in outs])
    return bs


async def beam_respond(
    state: GenerateState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    beams: BeamSettings,
    max_tokens: list[int],
    output: OutputParser | None = None,
):
    """Runs every prompt's beam search at once (prompt i to at most max_tokens[i] tokens); answers with n
    choices per prompt, best first."""
    chat = output is not None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    runs = [
        search(state, request, f"{rid}-p{i}", p, beams, m)
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    searches = await asyncio.gather(*runs)
    if any(s is None for s in searches):
        return Response(status_code=499)
    tokenizer = state.client.tokenizer
    choices = []
    for prompt, bs in zip(prompts, searches, strict=True):
        for hyp in bs.results():
            text = decode_output(tokenizer, prompt, _without_eos(hyp), skip_special_tokens=True)
            choices.append(_choice(len(choices), text, hyp, output))
    completion_tokens = sum(len(h.tokens) for bs in searches for h in bs.results())
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": state.config.served_model_name,
        "choices": choices,
        "usage": usage(sum(len(p) for p in prompts), completion_tokens),
        "system_fingerprint": None,
    }


def _without_eos(hyp: Hypothesis) -> list[int]:
    return list(hyp.tokens[:-1] if hyp.is_eos else hyp.tokens)


def _choice(index: int, text: str, hyp: Hypothesis, output: OutputParser | None) -> dict:
    reason = "stop" if hyp.is_eos else "length"
    if output is None:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
    parsed = output.final(text)
    return {
        "index": index,
        "message": chat_message(output, parsed),
        "logprobs": None,
        "finish_reason": finish_reason(reason, bool(parsed.calls)),
        "stop_reason": None,
    }
