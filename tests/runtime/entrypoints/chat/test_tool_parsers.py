"""Every tool-call parser on outputs its model family writes (a call, several calls, no call, malformed
output), whole and streamed token by token: the stream's fragments add up to the whole response's calls,
each call's id and name come before its arguments, and content never includes call syntax."""

import json

import pytest
from spyre_runtime.entrypoints.chat.chat_output import OutputParser
from spyre_runtime.entrypoints.chat.tool_parsers import TOOL_PARSERS, RequiredToolParser
from spyre_runtime.entrypoints.chat.tools import ToolPlan

W = {"city": "Paris", "unit": "celsius"}
T = {"timezone": "Europe/Paris"}

# (parser, recorded output, expected content (None: no content), expected calls [(name, arguments)])
TABLE = [
    # IBM Granite 3.x: the whole output is a JSON array, after <|tool_call|> (3.0) or <tool_call> (3.1+)
    (
        "granite",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        None,
        [("get_weather", W)],
    ),
    (
        "granite",
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]',
        None,
        [("get_weather", W), ("get_time", T)],
    ),
    (
        "granite",
        "The weather in Paris is sunny, 21 degrees.",
        "The weather in Paris is sunny, 21 degrees.",
        [],
    ),
    ("granite", "[1, 2, 3] are the first numbers.", "[1, 2, 3] are the first numbers.", []),
    (
        "granite",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"',
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"',
        [],
    ),
    ("granite", '[{"arguments": {}}]', '[{"arguments": {}}]', []),  # a call without a name
    # Hermes 2 Pro, Qwen 2.5/3: content, then <tool_call> blocks
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>",
        None,
        [("get_weather", W)],
    ),
    (
        "hermes",
        'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"timezone": "Europe/Paris"}}\n</tool_call>',
        "Let me check both.\n",
        [("get_weather", W), ("get_time", T)],
    ),
    ("hermes", "I cannot check the weather, sorry.", "I cannot check the weather, sorry.", []),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
        [],
    ),
    # Llama 3.1+: JSON objects (parameters or arguments), several joined by ';'
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        None,
        [("get_weather", W)],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}',
        None,
        [("get_weather", W), ("get_time", T)],
    ),
    ("llama3_json", "Paris is the capital of France.", "Paris is the capital of France.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        [],
    ),
    # Mistral: content, then [TOOL_CALLS] and a JSON array (before v11) or name{arguments} (v11+)
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        None,
        [("get_weather", W)],
    ),
    (
        "mistral",
        'Sure.[TOOL_CALLS]get_weather{"city": "Paris", "unit": "celsius"}'
        '[TOOL_CALLS]get_time{"timezone": "Europe/Paris"}',
        "Sure.",
        [("get_weather", W), ("get_time", T)],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}',
        None,
        [("get_weather", W)],
    ),
    (
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"timezone": "Europe/Paris"}',
        "Sure.",
        [("get_weather", W), ("get_time", T)],
    ),
    ("mistral", "It is sunny in Paris.", "It is sunny in Paris.", []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}]',
        [],
    ),
]


def run(plan, text):
    return OutputParser(plan).final(text)


def stream(plan, text, step):
    """Feeds the text `step` characters at a time; returns the stream and its deltas."""
    s = OutputParser(plan).stream()
    deltas = []
    for end in range(step, len(text) + step, step):
        deltas.append(s.feed(text[:end], end >= len(text)))
    return s, deltas


@pytest.mark.parametrize(("parser", "text", "content", "calls"), TABLE)
def test_parser_reads_its_recorded_output(parser, text, content, calls):
    got = run(ToolPlan("auto", TOOL_PARSERS[parser]()), text)
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls
    assert len({c.id for c in got.calls}) == len(calls) and all(c.id.startswith("call_") for c in got.calls)


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize(("parser", "text", "content", "calls"), TABLE)
def test_streamed_deltas_add_up_to_the_whole_response(parser, text, content, calls, step):
    s, deltas = stream(ToolPlan("auto", TOOL_PARSERS[parser]()), text, step)
    streamed = "".join(d.content for d in deltas)
    sent = s.sent()
    if calls or not s.tools_called:
        assert streamed == (content or "")
        assert [(c.name, json.loads(c.arguments)) for c in sent.calls] == calls
    else:  # malformed after a call's name went out: the stream keeps the call, and no call text as content
        assert text.startswith(streamed) and sent.calls[0].name in text[len(streamed) :]
        calls = sent.calls
    seen = set()
    for d in deltas:
        for c in d.calls:
            if c.id is not None:
                assert c.index not in seen and c.name and c.arguments == ""  # id and name first, alone
                seen.add(c.index)
            else:
                assert c.index in seen and c.arguments  # then argument fragments
    assert seen == set(range(len(calls)))


def test_content_before_a_call_streams_at_once_and_a_marker_is_held_back():
    s = OutputParser(ToolPlan("auto", TOOL_PARSERS["hermes"]())).stream()
    assert s.feed("Let me look", False).content == "Let me look"
    assert s.feed("Let me look <tool", False).content == " "
    assert s.feed("Let me look <tool_c", False).content == ""
    assert s.feed('Let me look <tool_call>{"name": "f"', False).calls[0].name == "f"
    assert (
        s.feed('Let me look <tool_call>{"name": "f", "arguments": {}}</tool_call> ok', True)
        .calls[0]
        .arguments
        == "{}"
    )
    assert s.content == "Let me look " and s.tools_called


def test_a_held_back_tail_that_is_not_a_marker_comes_out_at_the_end():
    s = OutputParser(ToolPlan("auto", TOOL_PARSERS["hermes"]())).stream()
    assert s.feed("a <tool", False).content == "a "
    assert s.feed("a <tool", True).content == "<tool"
    assert not s.tools_called


def test_named_function_output_is_the_arguments():
    plan = ToolPlan("named", function="get_weather")
    text = '{"city": "Paris"}'
    got = run(plan, text)
    assert got.content is None and [(c.name, c.arguments) for c in got.calls] == [("get_weather", text)]
    _, deltas = stream(plan, text, 4)
    first = deltas[0].calls
    assert first[0].name == "get_weather" and first[0].id and first[0].arguments == ""
    assert "".join(c.arguments for d in deltas for c in d.calls) == text


def test_required_output_is_an_array_of_name_and_parameters():
    plan = ToolPlan("required", RequiredToolParser())
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    )
    got = run(plan, text)
    assert [(c.name, c.arguments) for c in got.calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]
    one = run(ToolPlan("required", RequiredToolParser(), parallel=False), text)
    assert [c.name for c in one.calls] == ["get_weather"]  # parallel_tool_calls: false keeps the first
