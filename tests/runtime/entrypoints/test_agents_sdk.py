"""The OpenAI Agents SDK (`openai-agents`) runs a small agent with one function tool against the server on
SmolLM2-135M-Instruct, through both of its OpenAI models (OpenAIChatCompletionsModel on
/v1/chat/completions, OpenAIResponsesModel on /v1/responses), each run whole and streamed, to a finished
run: turn 1 must call the tool (tool_choice required, enforced by the grammar), the SDK runs it and sends
its result back, and turn 2 (tool_choice reset to auto, as the SDK does after a tool call) answers."""

import asyncio
from pathlib import Path

import agents
import pytest
from spyre_runtime.testing.models import prepare_smollm2

from tests.runtime.serverproc import ServerProcess

pytestmark = pytest.mark.slow

ENV = {"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_USE_CB": "1"}
ARGS = (
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "2",
    "--max-num-batched-tokens",
    "256",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = prepare_smollm2(Path.home() / ".cache/spyre-serve/models/smollm2")
    log = tmp_path_factory.mktemp("agents") / "server.log"
    srv = ServerProcess(model, ENV, log, served_name="smol", extra_args=ARGS)
    with srv.serving(timeout=600):
        yield srv


def weather_agent(model, calls: list[str]):
    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 degrees Celsius in {city}."

    settings = agents.ModelSettings(
        tool_choice="required", max_tokens=48, temperature=0, extra_body={"repetition_penalty": 1.1}
    )
    return agents.Agent(
        name="weather",
        instructions="You answer questions about the weather. Call get_weather, then answer in one sentence.",
        tools=[get_weather],
        model=model,
        model_settings=settings,
    )


async def run(agent, streamed: bool):
    question = "What is the weather in Paris?"
    if not streamed:
        return await agents.Runner.run(agent, question, max_turns=4), []
    result = agents.Runner.run_streamed(agent, question, max_turns=4)
    kinds = [event.type async for event in result.stream_events()]
    return result, kinds


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_an_agent_calls_its_tool_and_finishes(server, api, streamed):
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # no trace export: nothing leaves this machine
    client = AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=600)
    model_class = (
        agents.OpenAIChatCompletionsModel if api == "chat_completions" else agents.OpenAIResponsesModel
    )
    calls: list[str] = []
    result, kinds = asyncio.run(
        run(weather_agent(model_class(model="smol", openai_client=client), calls), streamed)
    )
    items = [type(item).__name__ for item in result.new_items]
    assert items[:2] == ["ToolCallItem", "ToolCallOutputItem"], items
    assert (
        items[-1] == "MessageOutputItem" and len(calls) >= 1 and all(isinstance(c, str) and c for c in calls)
    )
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert len(result.raw_responses) >= 2  # the tool call, then the answer
    if streamed:
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    print(api, "streamed" if streamed else "whole", calls, repr(result.final_output))
