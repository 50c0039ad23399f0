"""Every --tool-call-parser end to end through /v1/chat/completions (issue 37): the tiny model's output is
forced by a grammar (guided_choice, llguidance) into each family's own layout, and the official `openai`
client must get the calls the layout holds, whole and streamed (the id and name first, then argument
fragments that add up to the whole response's arguments). One server per parser; eager, tiny."""

from __future__ import annotations

import json

import pytest

from tests.runtime.entrypoints.conftest import TOOL_SERVER_ENV
from tests.runtime.serverproc import ServerProcess

W = {"city": "Rome"}
T = {"utc": True}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
MESSAGES = [{"role": "user", "content": "Weather in Rome, and the time?"}]

# parser -> [(the output forced on the model, the content the client gets, the calls it gets)]
CASES = {
    "granite": [
        (
            '<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
            '{"name": "get_time", "arguments": {"utc": true}}]',
            None,
            [("get_weather", W), ("get_time", T)],
        ),
        ('<|tool_call|>[{"name": "get_time", "arguments": {"utc": true}}]', None, [("get_time", T)]),
    ],
    "hermes": [
        (
            'Ok. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
            "Ok. ",
            [("get_weather", W), ("get_time", {})],
        ),
    ],
    "llama3_json": [
        (
            '{"name": "get_weather", "parameters": {"city": "Rome"}}; '
            '{"name": "get_time", "parameters": {"utc": true}}',
            None,
            [("get_weather", W), ("get_time", T)],
        ),
    ],
    "mistral": [
        (
            'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{"utc": true}',
            "Sure.",
            [("get_weather", W), ("get_time", T)],
        ),
        ('[TOOL_CALLS]get_weather{"city": "Rome"}', None, [("get_weather", W)]),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]',
            None,
            [("get_weather", W)],
        ),
    ],
}
PLAIN = ("It is sunny in Rome.", "It is sunny in Rome.", [])  # no call: content, for every parser
ALL = [(parser, *case) for parser, cases in CASES.items() for case in [*cases, PLAIN]]


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    """The server of a parser, started when its first test asks; the cases come grouped by parser, so the
    previous parser's server stops then (one server at a time)."""
    current: dict[str, ServerProcess] = {}
    serving = None

    def get(parser: str) -> ServerProcess:
        nonlocal serving
        if parser not in current:
            if serving is not None:
                serving.__exit__(None, None, None)
                current.clear()
            log = tmp_path_factory.mktemp(f"tools-{parser}") / "server.log"
            args = ("--enable-auto-tool-choice", "--tool-call-parser", parser)
            serving = ServerProcess(tiny_model, TOOL_SERVER_ENV, log, extra_args=args).serving()
            current[parser] = serving.__enter__()
        return current[parser]

    try:
        yield get
    finally:
        if serving is not None:
            serving.__exit__(None, None, None)


def ask(srv: ServerProcess, text: str, **kw):
    return srv.client(timeout=600).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=128,
        extra_body={"guided_choice": [text]},
        **kw,
    )


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL)
def test_parser_reads_the_forced_output_whole_and_streamed(servers, parser, text, content, calls):
    srv = servers(parser)
    choice = ask(srv, text).choices[0]
    reason = "tool_calls" if calls else "stop"
    assert choice.finish_reason == reason, choice
    assert choice.message.content == content
    got = [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls or ()]
    assert got == calls
    assert all(t.id.startswith("call_") and t.type == "function" for t in choice.message.tool_calls or ())

    streamed: dict[int, dict] = {}
    text_parts, reasons = [], []
    for chunk in ask(srv, text, stream=True):
        for c in chunk.choices:
            reasons += [c.finish_reason] if c.finish_reason else []
            text_parts.append(c.delta.content or "")
            for tc in c.delta.tool_calls or ():
                if tc.id is not None:  # the id and the name come first, alone
                    assert tc.index not in streamed and tc.function.arguments == ""
                    streamed[tc.index] = {"name": tc.function.name, "arguments": ""}
                else:
                    assert tc.function.name is None and tc.index in streamed
                    streamed[tc.index]["arguments"] += tc.function.arguments
    assert reasons == [reason] and "".join(text_parts) == (content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == calls
    assert [c["arguments"] for c in streamed.values()] == [
        t.function.arguments for t in choice.message.tool_calls
    ]
