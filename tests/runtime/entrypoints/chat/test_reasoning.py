"""Reasoning output: each --reasoning-parser on outputs its model family writes (reasoning then answer,
no reasoning, reasoning cut off, markers in other places), whole and streamed; reasoning together with
tool calls (calls are read from the answer only) and with structured output (the grammar starts once the
reasoning ends); and a server with `--reasoning-parser deepseek_r1` through the `openai` client."""

import pytest
import torch
from spyre_runtime.entrypoints.chat.chat_output import OutputParser
from spyre_runtime.entrypoints.chat.reasoning import REASONING_PARSERS
from spyre_runtime.entrypoints.chat.tool_parsers import TOOL_PARSERS
from spyre_runtime.entrypoints.chat.tools import ToolPlan
from spyre_runtime.sampling.guided import GuideCompiler

from tests.httpclient import HTTP
from tests.runtime.serverproc import ServerProcess

# (parser, recorded output, reasoning (None: the output has none), content)
TABLE = [
    (
        "deepseek_r1",
        "<think>\n2 + 2 is 4.\n</think>\n\nThe answer is 4.",
        "\n2 + 2 is 4.\n",
        "\n\nThe answer is 4.",
    ),
    # the template opened <think>: the output starts inside the reasoning
    ("deepseek_r1", "2 + 2 is 4.\n</think>\n\nThe answer is 4.", "2 + 2 is 4.\n", "\n\nThe answer is 4."),
    (
        "deepseek_r1",
        "<think>\nStill thinking when max_tokens ran out",
        "\nStill thinking when max_tokens ran out",
        None,
    ),
    ("deepseek_r1", "<think></think>Quick answer.", "", "Quick answer."),
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n", "\n\nHello!"),
    ("qwen3", "Hello! No thinking today.", None, "Hello! No thinking today."),
    (
        "qwen3",
        "An answer that mentions </think> in passing.",
        None,
        "An answer that mentions </think> in passing.",
    ),
    (
        "granite",
        "Here is my thought process: The user wants a haiku. Here is my response: Waves fold into foam",
        " The user wants a haiku. ",
        " Waves fold into foam",
    ),
    ("granite", "Here's my thought process:\nShort.\nHere's my response:\nDone.", "\nShort.\n", "\nDone."),
    ("granite", "Here is my thought process: cut off before the answer", " cut off before the answer", None),
    (
        "granite",
        "Waves fold into foam. Here is my response: (no thought process first)",
        None,
        "Waves fold into foam. Here is my response: (no thought process first)",
    ),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), TABLE)
def test_reasoning_parser_splits_its_recorded_output(parser, text, reasoning, content):
    out = OutputParser(reasoning=REASONING_PARSERS[parser]()).final(text)
    assert (out.reasoning, out.content) == (reasoning, content)


@pytest.mark.parametrize("step", [1, 4])
@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), TABLE)
def test_streamed_reasoning_and_content_add_up_to_the_whole(parser, text, reasoning, content, step):
    stream = OutputParser(reasoning=REASONING_PARSERS[parser]()).stream()
    deltas = [stream.feed(text[:end], end >= len(text)) for end in range(step, len(text) + step, step)]
    assert "".join(d.reasoning for d in deltas) == (reasoning or "")
    assert "".join(d.content for d in deltas) == (content or "")
    # no marker text leaks into either part while streaming
    for d in deltas:
        assert "</think>" not in d.reasoning and "my response:" not in d.reasoning


def test_include_reasoning_false_drops_the_reasoning_but_not_the_split():
    out = OutputParser(reasoning=REASONING_PARSERS["deepseek_r1"](), include_reasoning=False).final(
        TABLE[0][1]
    )
    assert out.reasoning is None and out.content == "\n\nThe answer is 4."


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_calls_are_read_from_the_answer_only():
    plan = ToolPlan("auto", TOOL_PARSERS["hermes"]())
    parser = OutputParser(plan, REASONING_PARSERS["deepseek_r1"]())
    text = f"<think>Maybe {CALL}? I should call it.</think>\n{CALL}"
    out = parser.final(text)
    assert out.reasoning == f"Maybe {CALL}? I should call it."
    assert out.content is None and [(c.name, c.arguments) for c in out.calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    stream = parser.stream()
    deltas = [stream.feed(text[:end], end >= len(text)) for end in range(3, len(text) + 3, 3)]
    assert "".join(d.reasoning for d in deltas) == out.reasoning
    calls = [c for d in deltas for c in d.calls]
    assert calls[0].name == "get_weather" and "".join(c.arguments for c in calls) == '{"city": "Paris"}'
    # the call goes out after all the reasoning
    first_call = next(i for i, d in enumerate(deltas) if d.calls)
    assert all(not d.reasoning for d in deltas[first_call:])


def test_a_named_call_starts_after_the_reasoning():
    parser = OutputParser(ToolPlan("named", function="f"), REASONING_PARSERS["qwen3"]())
    stream = parser.stream()
    assert not stream.feed("<think>plan", False).calls
    assert not stream.feed("<think>plan</think>", False).calls
    d = stream.feed('<think>plan</think>{"a": 1}', True)
    assert [(c.name, c.arguments) for c in d.calls] == [("f", ""), (None, '{"a": 1}')]
    assert parser.final('<think>plan</think>{"a": 1}').calls[0].arguments == '{"a": 1}'


def test_structured_output_starts_when_the_reasoning_ends(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    guides = GuideCompiler(tok, len(tok), frozenset({tok.eos_token_id}))
    guide = guides.defer(guides.compile("json_object", None), ("</think>",)).new_guide()

    def allowed() -> int:
        bitmask = torch.full((1, (len(tok) + 31) // 32), -1, dtype=torch.int32)
        guide.fill(bitmask, 0)
        return int(sum(bin(w & 0xFFFFFFFF).count("1") for w in bitmask[0].tolist()))

    everything = allowed()
    for t in tok("Let me think", add_special_tokens=False)["input_ids"]:
        guide.accept(t)
        assert allowed() == everything and not guide.is_complete  # free while reasoning
    for t in tok("</think>", add_special_tokens=False)["input_ids"]:
        guide.accept(t)
    assert allowed() < everything  # the JSON grammar now masks
    for t in tok("{}", add_special_tokens=False)["input_ids"]:
        guide.accept(t)
    assert guide.is_complete


ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
    "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64",
    "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "32",
    "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "2",
}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("reasoning") / "server.log"
    srv = ServerProcess(tiny_model, ENV, log, extra_args=("--reasoning-parser", "deepseek_r1"))
    with srv.serving():
        yield srv


def test_server_moves_reasoning_into_reasoning_content(server):
    client = server.client()
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "seed": 3}
    kw |= {"temperature": 1.0, "extra_body": {"ignore_eos": True}}
    msg = client.chat.completions.create(**kw).choices[0].message
    # random weights never write </think>: everything is reasoning (the template opened it)
    assert msg.reasoning_content and msg.content is None
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    assert streamed == msg.reasoning_content
    assert all(not c.choices[0].delta.content for c in chunks if c.choices)
    # structured output waits for the end of the reasoning: here it never ends, so nothing is forced
    fmt = client.chat.completions.create(**kw, response_format={"type": "json_object"}).choices[0]
    assert fmt.message.reasoning_content == msg.reasoning_content and fmt.finish_reason == "length"
    hidden = client.chat.completions.create(
        **{**kw, "extra_body": {"ignore_eos": True, "include_reasoning": False}}
    )
    assert hidden.choices[0].message.reasoning_content is None


def test_reasoning_effort_reaches_the_chat_template(server):
    template = "{{ reasoning_effort }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    res = HTTP.post(
        server.base + "/v1/chat/completions",
        json={**body, "chat_template": template, "reasoning_effort": "low"},
    )
    assert res.status_code == 200, res.text
    count = HTTP.post(
        server.base + "/tokenize", json={"prompt": "low|hi", "add_special_tokens": False}
    ).json()["count"]
    assert res.json()["usage"]["prompt_tokens"] == count
    bad = HTTP.post(server.base + "/v1/chat/completions", json={**body, "reasoning_effort": "extreme"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
    assert HTTP.get(server.base + "/health").status_code == 200
