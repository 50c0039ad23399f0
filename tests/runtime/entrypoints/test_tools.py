"""Tool calling on /v1/chat/completions (tiny random model, eager backend, `--enable-auto-tool-choice
--tool-call-parser hermes`), through the official `openai` client's typed objects: a named function and
`required` are enforced by the grammar, so even random weights write arguments that parse and validate;
`auto` reads calls out of the text (here forced with guided_choice) and falls back to content; streams send
each call's id and name, then argument fragments; tool messages render through the template; bad tools get
a 400 naming the field while /health stays 200."""

import json

import jsonschema
import openai
import pytest

from tests.httpclient import HTTP

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"utc": {"type": "boolean"}, "offset": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["utc", "offset"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tool_server):
    return tool_server


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, **kw):
    kw.setdefault("model", "tiny")
    kw.setdefault("messages", MSGS)
    kw.setdefault("max_tokens", 128)
    return client.chat.completions.create(**kw)


def check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", range(3))
def test_a_named_function_gets_arguments_that_validate(client, seed):
    choice = {"type": "function", "function": {"name": "get_time"}}
    res = chat(client, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed)
    c = res.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
    check_call(c.message.tool_calls[0])


@pytest.mark.parametrize("seed", range(3))
def test_required_gets_calls_to_the_given_tools_that_validate(client, seed):
    kw = {"tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": seed}
    res = chat(client, parallel_tool_calls=False, **kw)
    c = res.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    check_call(c.message.tool_calls[0])
    # parallel calls: random weights may go on adding calls until max_tokens; every finished one validates
    many = chat(client, max_tokens=120, **kw).choices[0]
    for call in many.message.tool_calls:
        check_call(call)
    assert many.finish_reason == "tool_calls" or not many.message.tool_calls


def streamed(client, **kw):
    """The chunks' tool-call deltas per index (id, type, name, arguments fragments) and finish reasons."""
    calls: dict[int, dict] = {}
    reasons = []
    order = []
    for chunk in chat(client, stream=True, **kw):
        for choice in chunk.choices:
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
            for tc in choice.delta.tool_calls or ():
                order.append((tc.index, tc.id is not None))
                if tc.id is not None:
                    assert tc.index not in calls and tc.type == "function" and tc.function.name
                    assert tc.function.arguments == ""  # the id and name come first, alone
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and tc.function.name is None
                    calls[tc.index]["arguments"] += tc.function.arguments
    return [calls[i] for i in sorted(calls)], reasons, order


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streams_send_id_and_name_then_argument_fragments(client, tool_choice):
    calls, reasons, order = streamed(client, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=4)
    assert reasons == ["tool_calls"] and calls
    assert sum(1 for _, first in order if not first) >= 2  # the arguments came in several fragments
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    whole = chat(client, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=4)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls
    ]


HERMES_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius", "days": 2}}'
    "\n</tool_call>"
)


def test_auto_reads_the_models_call_out_of_its_text(client):
    forced = {"guided_choice": ["I will check. " + HERMES_CALL]}
    res = chat(client, tools=TOOLS, tool_choice="auto", extra_body=forced)
    c = res.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "I will check. "
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Rome", "unit": "celsius", "days": 2})
    ]
    calls, reasons, _ = streamed(client, tools=TOOLS, extra_body=forced)  # auto is the default with tools
    assert reasons == ["tool_calls"]
    assert [(t["name"], t["arguments"]) for t in calls] == [
        (t.function.name, t.function.arguments) for t in c.message.tool_calls
    ]


def test_auto_falls_back_to_content_when_the_text_is_no_call(client):
    for text in ["It is sunny.", '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>']:
        res = chat(client, tools=TOOLS, extra_body={"guided_choice": [text]})
        c = res.choices[0]
        assert c.message.content == text and not c.message.tool_calls and c.finish_reason == "stop"
    none = chat(client, tools=TOOLS, tool_choice="none", extra_body={"guided_choice": [HERMES_CALL]})
    assert none.choices[0].message.content == HERMES_CALL and not none.choices[0].message.tool_calls


def test_tool_calls_and_results_render_through_the_template(server, client):
    template = (
        "{% for m in messages %}{{ m.role }}:"
        "{% for c in m.tool_calls or [] %} call {{ c.id }} {{ c.function.name }}"
        "({% for k, v in c.function.arguments.items() %}{{ k }}={{ v }}{% endfor %}){% endfor %}"
        "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %} {{ m.content }}\n{% endfor %}"
    )
    messages = [
        *MSGS,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    ids = HTTP.post(server.base + "/tokenize", json={"messages": messages, "chat_template": template}).json()[
        "tokens"
    ]
    text = HTTP.post(server.base + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == (
        "user: What is the weather in Paris?\nassistant: call call_1 get_weather(city=Paris) \n"
        "tool: [call_1] 21 C\n"
    )
    res = chat(client, messages=messages, tools=TOOLS, max_tokens=2, extra_body={"chat_template": template})
    assert res.usage.prompt_tokens == len(ids)


BAD = [
    # (body changes, the parameter named, words in the message)
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
        "tools.0.function.parameters",
        "not a JSON Schema",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}]},
        "tools.0.function.parameters",
        "not a JSON Schema",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "not in tools",
    ),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice", "no tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name", "twice"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        "only one kind",
    ),
    ({"messages": [*MSGS, {"role": "tool", "content": "21 C"}]}, "messages.1.tool_call_id", "names the call"),
    (
        {
            "messages": [
                *MSGS,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                    ],
                },
            ]
        },
        "messages.1.tool_calls.0.function.arguments",
        "not JSON",
    ),
    (
        {"messages": [*MSGS, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
        "messages.1.tool_calls.0.function.arguments",
        "",
    ),
]


@pytest.mark.parametrize(("change", "param", "words"), BAD)
def test_bad_tools_get_a_400_naming_the_field(server, change, param, words):
    body = {"model": "tiny", "messages": MSGS, "max_tokens": 5, **change}
    res = HTTP.post(server.base + "/v1/chat/completions", json=body, timeout=60)
    assert res.status_code == 400, res.text
    err = res.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert HTTP.get(server.base + "/health").status_code == 200


def test_the_client_raises_bad_request_for_a_bad_tool(client):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}})
