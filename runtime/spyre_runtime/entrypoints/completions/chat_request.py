"""A chat completions request, checked in one pass before anything reaches the engine, in the order a
reader expects: the model and the number of sequences, beam search, the tools (tool_choice and its
grammar), the messages through the chat template (and an image-text model's images), the sampling
parameters against the engine's limits, and the choices. Each check and its 400 is the validator's,
prompts', tools' or beam search's own: this is the one place a chat body goes through them."""

from __future__ import annotations

from dataclasses import dataclass

from spyre_runtime.entrypoints.chat.chat_output import OutputParser
from spyre_runtime.entrypoints.chat.prompts import chat_prompt
from spyre_runtime.entrypoints.chat.tools import ChatSettings, plan_tools
from spyre_runtime.entrypoints.completions.beam import BeamSettings, check_beam
from spyre_runtime.entrypoints.completions.protocol import ChatCompletionRequest
from spyre_runtime.entrypoints.completions.state import GenerateState
from spyre_runtime.entrypoints.completions.validator import Choice
from spyre_runtime.entrypoints.server.errors import bad_request
from spyre_runtime.request import ImageInput
from spyre_runtime.sampling.params import SamplingParams


@dataclass(frozen=True)
class ChatInput:
    """What a checked chat request runs: its prompt, its images (an image-text model's), its sampling
    parameters, how its output is read, and its beam search or its choices."""

    prompt: list[int]
    images: ImageInput | None
    params: SamplingParams
    output: OutputParser
    beams: BeamSettings | None
    choices: list[Choice]  # none with beam search (it makes its own sequences)


async def check_chat(state: GenerateState, body: ChatCompletionRequest, settings: ChatSettings) -> ChatInput:
    v = state.ready_validator()
    v.model(body.model)
    v.num_sequences(1, body)
    beams = check_beam(body, state.config.use_cb, len(state.client.eos_ids))
    plan = plan_tools(body, settings)
    ids, images = await chat_prompt(state.client.tokenizer, body, state.images)
    if not ids:
        raise bad_request("messages", "the rendered prompt is empty")
    if images is not None and beams is not None:
        raise bad_request("use_beam_search", "is not supported with images")
    reasoning = settings.new_reasoning_parser()
    ends = reasoning.end_markers if reasoning else ()
    params = v.sampling(body, len(ids), chat=True, tools=plan, reasoning_end=ends)
    output = OutputParser(plan, reasoning, include_reasoning=body.include_reasoning is not False)
    choices = v.choices(body, params, 0) if beams is None else []
    return ChatInput(ids, images, params, output, beams, choices)
