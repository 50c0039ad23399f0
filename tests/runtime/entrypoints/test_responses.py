"""The Responses API (`POST /v1/responses`) on the tiny model (eager), through the official `openai`
client's typed objects: text and message input with instructions, the typed stream events in OpenAI's
order (adding up to the whole response), function tools through the same grammars and parsers as chat,
store: false keeps nothing while store: true keeps a response for GET and previous_response_id, and bad
input gets a 400 naming the Responses field."""

import json

import jsonschema
import openai
import pytest

from tests.httpclient import HTTP

TIME = {
    "type": "object",
    "properties": {"utc": {"type": "boolean"}, "offset": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["utc", "offset"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_time", "description": "The time", "parameters": TIME, "strict": True}
]


@pytest.fixture(scope="module")
def server(tool_server):
    return tool_server


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def count(server, **body) -> int:
    return HTTP.post(server.base + "/tokenize", json=body).json()["count"]


def test_text_input_with_instructions(server, client):
    r = client.responses.create(
        model="tiny", input="hello", instructions="Be brief.", max_output_tokens=8, extra_body={"seed": 1}
    )
    assert (
        isinstance(r, openai.types.responses.Response) and r.object == "response" and r.id.startswith("resp_")
    )
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 8
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    assert r.usage.input_tokens == count(server, messages=messages)
    assert r.output_text == "".join(p.text for item in r.output for p in item.content)
    assert r.store is False and r.instructions == "Be brief."
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_message_input_with_content_parts(server, client):
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Bonjour"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Salut", "annotations": []}]},
        {"role": "user", "content": "Et toi ?"},
    ]
    r = client.responses.create(model="tiny", input=items, max_output_tokens=4)
    messages = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Bonjour"},
        {"role": "assistant", "content": "Salut"},
        {"role": "user", "content": "Et toi ?"},
    ]
    assert r.usage.input_tokens == count(server, messages=messages)


def test_stream_events_are_typed_ordered_and_add_up(client):
    kw = {
        "model": "tiny",
        "input": "tell me",
        "max_output_tokens": 12,
        "temperature": 1.0,
        "extra_body": {"seed": 5},
    }
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert isinstance(
        events[-1],
        openai.types.responses.ResponseCompletedEvent | openai.types.responses.ResponseIncompleteEvent,
    )
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_time"}])
def test_function_tools_get_calls_whose_arguments_validate(client, tool_choice):
    kw = {"model": "tiny", "input": "What time is it?", "tools": TOOLS, "tool_choice": tool_choice}
    kw |= {
        "parallel_tool_calls": False,
        "max_output_tokens": 100,
        "temperature": 1.0,
        "extra_body": {"seed": 2},
    }
    r = client.responses.create(**kw)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_time" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TIME)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == final.output[0].arguments == call.arguments
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_time" and added.item.arguments == ""


def test_store_false_keeps_nothing_and_store_true_continues_a_conversation(server, client):
    kept = client.responses.create(
        model="tiny", input="Remember: 42.", instructions="Be terse.", max_output_tokens=3, store=True
    )
    assert kept.store is True and client.responses.retrieve(kept.id).id == kept.id
    nothing = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(nothing.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(
            model="tiny", input="next", previous_response_id=nothing.id, max_output_tokens=2
        )
    assert err.value.body["param"] == "previous_response_id"
    follow = client.responses.create(
        model="tiny", input="What was it?", previous_response_id=kept.id, max_output_tokens=2
    )
    # the earlier turn (its input and output) without its instructions, then the new input
    messages = [
        {"role": "user", "content": "Remember: 42."},
        {"role": "assistant", "content": kept.output_text},
        {"role": "user", "content": "What was it?"},
    ]
    assert follow.usage.input_tokens == count(server, messages=messages)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_a_function_call_and_its_output_come_back_as_input(server, client):
    arguments = '{"utc": true, "offset": 1}'
    call = {"type": "function_call", "call_id": "call_7", "name": "get_time", "arguments": arguments}
    output = {"type": "function_call_output", "call_id": "call_7", "output": "13:05"}
    thought = {"type": "reasoning", "id": "rs_1", "summary": []}  # dropped, as templates drop reasoning
    items = [{"role": "user", "content": "time?"}, thought, call, output]
    r = client.responses.create(model="tiny", input=items, tools=TOOLS, max_output_tokens=2)
    # the same conversation as chat messages: an assistant turn with the call, then the tool's result
    tool_call = {"id": "call_7", "type": "function", "function": {"name": "get_time", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": "call_7", "content": "13:05"},
    ]
    chat_tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    assert r.usage.input_tokens == count(server, messages=messages, tools=chat_tools)


BAD = [
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input.0.type", "not supported"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id", "required"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input.0.content.0",
        "only text",
    ),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input.0.role", "must be one of"),
    ({"input": []}, "input", "empty"),
    (
        {"tools": [{"type": "function", "name": "f", "parameters": {"type": 7}}]},
        "tools.0.parameters",
        "not a JSON Schema",
    ),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", ""),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "needs a schema"),
    ({"max_output_tokens": 100_000}, "max_output_tokens", ""),
    ({"background": True}, "background", "not supported"),
    ({"include": ["message.output_text.logprobs"]}, "include", "logprobs"),
    ({"model": "other"}, "model", "does not exist"),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]},
        "input.0",
        "not JSON",
    ),
]


@pytest.mark.parametrize(("change", "param", "words"), BAD)
def test_bad_input_gets_a_4xx_naming_the_field(server, change, param, words):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, **change}
    res = HTTP.post(server.base + "/v1/responses", json=body, timeout=60)
    assert 400 <= res.status_code < 500, res.text
    err = res.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert HTTP.get(server.base + "/health").status_code == 200
