"""The OpenAI API surface, driven with the official `openai` client (and raw HTTP for what a client would
never send): every sampling parameter, logprobs and echo, n and best_of, structured output, the tokenizer
and model endpoints, chat templates, the API key, and a catalog of bad or hostile requests that each get
their 4xx while /health stays 200. One server for the module (eager backend: the API does not depend on it).
"""

import json
import re
from collections import Counter

import httpx
import jsonschema
import openai
import pytest

from tests.httpclient import HTTP
from tests.runtime.serverproc import ServerProcess

API_KEY = "test-key-14"
HEADERS = {"authorization": f"Bearer {API_KEY}"}
ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
    "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64,128",
    "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "64,64",
    "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "4,2",
}
VOCAB = 512  # the tiny model's tokenizer


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("api") / "server.log"
    srv = ServerProcess(tiny_model, ENV, log, extra_args=("--api-key", API_KEY))
    with srv.serving():
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key=API_KEY)


def post(server, path, payload=None, content=None, headers=HEADERS):
    return HTTP.post(
        server.base + path,
        json=payload,
        content=content,
        timeout=60,
        headers={"content-type": "application/json", **headers},
    )


def complete(client, **kw):
    kw.setdefault("model", "tiny")
    kw.setdefault("prompt", "The capital of France")
    return client.completions.create(**kw)


# ---- a catalog of bad and hostile requests ----------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
P = {"model": "tiny", "prompt": "hi"}
M = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}

CATALOG = [
    # (path, body (dict) or raw bytes, status, the parameter named (None: no param), words in the message)
    (C, b'{"model": "tiny", "prompt": ', 400, None, "not valid JSON"),
    (C, b"[1, 2, 3]", 400, None, ""),
    (C, b'"just a string"', 400, None, ""),
    (C, b"[" * 100_000 + b"]" * 100_000, 400, None, ""),
    (C, {"model": "tiny"}, 400, "prompt", "required"),
    (C, {"prompt": "hi"}, 400, "model", "required"),
    (C, {**P, "model": "nope"}, 404, "model", "does not exist"),
    (C, {**P, "prompt": ""}, 400, "prompt", "empty"),
    (C, {**P, "prompt": []}, 400, "prompt", "empty"),
    (C, {**P, "prompt": [[]]}, 400, "prompt", "empty"),
    (C, {**P, "prompt": [1, 2, 999_999]}, 400, "prompt", "outside the vocabulary"),
    (C, {**P, "prompt": [5, -1]}, 400, "prompt", "outside the vocabulary"),
    (C, {**P, "prompt": [2**70]}, 400, "prompt", "outside the vocabulary"),
    (C, {**P, "prompt": [[1, 2], [VOCAB]]}, 400, "prompt", "outside the vocabulary"),
    (C, {**P, "prompt": [1.5, 2]}, 400, "prompt", ""),
    (C, {**P, "prompt": ["a"] * 65}, 400, "prompt", "at most 64 prompts"),
    (C, b'{"model": "tiny", "prompt": "\\ud800 lone surrogate"}', 400, "prompt", "could not be tokenized"),
    (C, {**P, "prompt": "word " * 300, "max_tokens": 1}, 400, "prompt", "fits no compiled shape"),
    (C, {**P, "max_tokens": 65}, 400, "max_tokens", "compiled shapes"),
    (C, {**P, "max_tokens": 0}, 400, "max_tokens", ""),
    (C, {**P, "max_tokens": "many"}, 400, "max_tokens", ""),
    (C, {**P, "max_tokens": True}, 400, "max_tokens", ""),
    (C, {**P, "seed": 2**64}, 400, "seed", ""),
    (C, {**P, "seed": -(2**63) - 1}, 400, "seed", ""),
    (C, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, "temperature", "finite"),
    (C, b'{"model": "tiny", "prompt": "hi", "top_p": Infinity}', 400, "top_p", "finite"),
    (C, {**P, "temperature": -0.5}, 400, "temperature", ""),
    (C, {**P, "temperature": "hot"}, 400, "temperature", ""),
    (C, {**P, "top_p": 0}, 400, "top_p", ""),
    (C, {**P, "top_k": -2}, 400, "top_k", ""),
    (C, {**P, "min_p": 1.5}, 400, "min_p", ""),
    (C, {**P, "presence_penalty": 2.5}, 400, "presence_penalty", ""),
    (C, {**P, "frequency_penalty": -3}, 400, "frequency_penalty", ""),
    (C, {**P, "repetition_penalty": 0}, 400, "repetition_penalty", ""),
    (C, {**P, "stop": [""]}, 400, "stop", "must not be empty"),
    (C, {**P, "stop": ""}, 400, "stop", "must not be empty"),
    (C, {**P, "stop": [str(i) for i in range(17)]}, 400, "stop", "at most 16"),
    (C, {**P, "stop": ["x" * 1001]}, 400, "stop", "at most 1000"),
    (C, {**P, "stop_token_ids": [VOCAB + 5]}, 400, "stop_token_ids", "outside the vocabulary"),
    (C, {**P, "logit_bias": {"abc": 1}}, 400, "logit_bias", "token ids"),
    (C, {**P, "logit_bias": {str(VOCAB): 1}}, 400, "logit_bias", "outside the vocabulary"),
    (C, {**P, "logit_bias": {"5": 1000}}, 400, "logit_bias", "[-100, 100]"),
    (C, {**P, "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias", ""),
    (C, {**P, "n": 0}, 400, "n", ""),
    (C, {**P, "n": 100_000}, 400, "n", ""),
    (C, {**P, "n": 2, "best_of": 1}, 400, "best_of", "at least n"),
    (C, {**P, "best_of": 5}, 400, "best_of", "batch size (4)"),
    (C, {**P, "best_of": 2, "stream": True}, 400, "best_of", "stream"),
    (C, {**P, "logprobs": 21}, 400, "logprobs", ""),
    (C, {**P, "min_tokens": 10, "max_tokens": 5}, 400, "min_tokens", "at most max_tokens"),
    (C, {**P, "echo": True, "stream": True}, 400, "echo", "stream"),
    (C, {**P, "stream": "yes"}, 400, "stream", ""),
    (C, {**P, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream is true"),
    (C, {**P, "frobnicate": 1}, 400, "frobnicate", "unknown parameter"),
    (C, {**P, "suffix": "!"}, 400, "suffix", "not supported"),
    (C, {**P, "use_beam_search": True}, 400, "use_beam_search", "not supported"),
    (C, {**P, "response_format": {"type": "xml"}}, 400, "response_format.type", ""),
    (C, {**P, "response_format": {"type": "json_schema"}}, 400, "response_format", "json_schema.schema"),
    (C, {**P, "guided_regex": "(unclosed"}, 400, "guided_regex", "could not be compiled"),
    (C, {**P, "guided_json": {"type": "no-such-type"}}, 400, "guided_json", "could not be compiled"),
    (C, {**P, "guided_json": SCHEMA, "guided_regex": "a+"}, 400, "guided_regex", "only one kind"),
    (C, {**P, "guided_choice": []}, 400, "guided_choice", ""),
    (CHAT, {**M, "messages": []}, 400, "messages", ""),
    (CHAT, {**M, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", ""),
    (
        CHAT,
        {**M, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages.0.content.0",
        "not supported",
    ),
    (CHAT, {**M, "tool_choice": "required"}, 400, "tool_choice", ""),
    (CHAT, {**M, "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tool_choice", ""),
    (CHAT, {**M, "top_logprobs": 2}, 400, "top_logprobs", "logprobs: true"),
    (CHAT, {**M, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs", "tokenize"),
    (CHAT, {**M, "chat_template": "{% for m in messages %}"}, 400, "messages", "chat template"),
    (
        CHAT,
        {**M, "add_generation_prompt": True, "continue_final_message": True},
        400,
        "continue_final_message",
        "",
    ),
    (CHAT, {**M, "echo": True}, 400, "echo", "unknown parameter"),
    (CHAT, {**M, "messages": [{"role": "user", "content": "x " * 400}]}, 400, "prompt", "fits no compiled"),
    (CHAT, {**M, "max_completion_tokens": 0}, 400, "max_completion_tokens", ""),
    ("/tokenize", {"model": "tiny"}, 400, "prompt", "exactly one"),
    ("/detokenize", {"model": "tiny", "tokens": [-5]}, 400, "tokens", "outside the vocabulary"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), CATALOG)
def test_hostile_request_gets_its_4xx_and_the_engine_stays_healthy(server, path, body, status, param, words):
    raw = body if isinstance(body, bytes) else None
    res = post(server, path, None if raw else body, content=raw)
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert words in err["message"], err
    assert HTTP.get(server.base + "/health").status_code == 200


def test_the_catalog_is_large():
    assert len(CATALOG) >= 30


def test_oversized_body_is_413_and_the_server_stays_up(server):
    res = post(server, C, content=b'{"model": "tiny", "prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}')
    assert res.status_code == 413
    assert HTTP.get(server.base + "/health").status_code == 200
    # and the engine still answers
    assert post(server, C, {**P, "max_tokens": 2}).status_code == 200


def test_api_key_guards_everything_but_health_and_metrics(server):
    assert post(server, C, P, headers={}).status_code == 401
    wrong = post(server, C, P, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert HTTP.get(server.base + "/v1/models").status_code == 401
    assert HTTP.get(server.base + "/health").status_code == 200
    assert HTTP.get(server.base + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()


# ---- nulls, tiny temperatures, extreme seeds: accepted and well-defined -----------------------------


def test_explicit_nulls_are_defaults(server):
    nulls = dict.fromkeys(
        [
            "temperature",
            "top_p",
            "top_k",
            "max_tokens",
            "stop",
            "seed",
            "n",
            "logprobs",
            "echo",
            "best_of",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "user",
            "stream",
            "stream_options",
            "response_format",
            "min_tokens",
            "ignore_eos",
        ],
    )
    res = post(server, C, {**P, **nulls})
    assert res.status_code == 200, res.text
    assert res.json()["usage"]["completion_tokens"] >= 1
    chat = post(
        server,
        CHAT,
        {
            **M,
            "temperature": None,
            "max_completion_tokens": None,
            "tools": None,
            "tool_choice": None,
            "logprobs": None,
            "top_logprobs": None,
            "max_tokens": 3,
        },
    )
    assert chat.status_code == 200, chat.text


def test_a_tiny_temperature_is_greedy_and_extreme_seeds_work(client):
    greedy = complete(client, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    tiny = complete(client, max_tokens=10, temperature=1e-40, extra_body={"ignore_eos": True}).choices[0].text
    assert tiny == greedy
    for seed in (2**63 - 1, -(2**63), 0):
        a = complete(client, max_tokens=5, seed=seed, extra_body={"ignore_eos": True}).choices[0].text
        b = complete(client, max_tokens=5, seed=seed, extra_body={"ignore_eos": True}).choices[0].text
        assert a == b


# ---- sampling parameters ----------------------------------------------------------------------------


def test_n_choices_are_the_seeded_requests_seed_plus_i(client):
    kw = {"max_tokens": 12, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    res = complete(client, n=3, seed=5, **kw)
    assert [c.index for c in res.choices] == [0, 1, 2]
    singles = [complete(client, seed=5 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in res.choices] == singles
    assert len(set(singles)) > 1
    assert res.usage.completion_tokens == 36


def test_best_of_returns_the_most_likely_of_its_candidates(client):
    kw = {"max_tokens": 8, "temperature": 1.0, "seed": 11, "extra_body": {"ignore_eos": True}}
    candidates = complete(client, n=3, logprobs=0, **kw).choices
    totals = [sum(c.logprobs.token_logprobs) for c in candidates]
    best = complete(client, n=1, best_of=3, **kw).choices
    assert len(best) == 1 and best[0].text == candidates[totals.index(max(totals))].text
    assert best[0].logprobs is None  # not asked for


def test_several_prompts_get_one_choice_each_in_order(client):
    res = complete(client, prompt=["1 2 3", "Hello", "def"], max_tokens=4, temperature=0)
    assert [c.index for c in res.choices] == [0, 1, 2]
    alone = complete(client, prompt="Hello", max_tokens=4, temperature=0).choices[0].text
    assert res.choices[1].text == alone
    ids = complete(client, prompt=[[5, 6, 7], [8, 9]], max_tokens=4, temperature=0, n=2, seed=1)
    assert [c.index for c in ids.choices] == [0, 1, 2, 3] and ids.usage.prompt_tokens == 5


def test_completion_logprobs_layout_and_values(client):
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True}  # strings of byte tokens collide
    res = complete(client, max_tokens=6, temperature=0, logprobs=3, extra_body=body)
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and len(top) == 3 and top[token] == value
        assert value == max(top.values())  # greedy: the chosen token is the most likely
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_does(client):
    """lm-eval's local-completions loglikelihood: token-id prompts, echo, logprobs=1, max_tokens=1."""
    prompt = [40, 41, 42, 43, 44, 45]
    res = complete(client, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    detok = httpx.Client(headers=HEADERS)
    prompt_text = detok.post(str(client.base_url.join("/detokenize")), json={"tokens": prompt}).json()[
        "prompt"
    ]
    assert res.choices[0].text.startswith(prompt_text)
    # the prompt's scores (an eager pass) agree with the served path's logprob of the same token
    generated = complete(
        client, prompt=prompt[:-1], logprobs=0, max_tokens=1, temperature=0, logit_bias={str(prompt[-1]): 100}
    )
    served = generated.choices[0].logprobs.token_logprobs[0]
    assert lp.token_logprobs[len(prompt) - 1] == pytest.approx(served, abs=1e-3)


def test_chat_logprobs_layout(client):
    res = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = res.choices[0].logprobs.content
    assert 1 <= len(content) <= 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_streamed_logprobs_match_non_streamed(client):
    kw = {"max_tokens": 6, "temperature": 0, "logprobs": 1, "extra_body": {"ignore_eos": True}}
    full = complete(client, **kw).choices[0].logprobs.token_logprobs
    streamed = [
        x
        for c in complete(client, stream=True, **kw)
        if c.choices[0].logprobs
        for x in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(full)


def test_penalties_change_greedy_output_toward_less_repetition(client):
    kw = {"prompt": "Hello, world!", "max_tokens": 64, "temperature": 0, "logprobs": 0}
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True}

    def most_repeated(res):
        tokens = res.choices[0].logprobs.tokens
        assert all(t.startswith("token_id:") for t in tokens)
        return max(Counter(tokens).values())

    plain = complete(client, **kw, extra_body=body)
    assert most_repeated(plain) > 2  # the tiny model loops, so a penalty has something to do
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}):
        res = complete(client, **kw, extra_body={**body, **extra})
        assert most_repeated(res) < most_repeated(plain), extra


def test_logit_bias_top_k_min_p_and_min_tokens(client):
    forced = complete(client, max_tokens=5, temperature=0, logit_bias={"65": 100}, logprobs=0)
    assert len(set(forced.choices[0].logprobs.tokens)) == 1
    greedy = complete(client, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    top1 = complete(
        client, max_tokens=8, temperature=1.5, seed=3, extra_body={"ignore_eos": True, "top_k": 1}
    )
    assert top1.choices[0].text == greedy
    minp = complete(
        client, max_tokens=8, temperature=1.5, seed=3, extra_body={"ignore_eos": True, "min_p": 1.0}
    )
    assert minp.choices[0].text == greedy
    eos = (
        httpx.Client(headers=HEADERS)
        .post(
            str(client.base_url.join("/tokenize")), json={"prompt": "<|im_end|>", "add_special_tokens": False}
        )
        .json()["tokens"][0]
    )
    stops = complete(client, max_tokens=20, temperature=0, logit_bias={str(eos): 100})
    assert stops.choices[0].finish_reason == "stop" and stops.usage.completion_tokens == 1
    held = complete(
        client, max_tokens=20, temperature=0, logit_bias={str(eos): 100}, extra_body={"min_tokens": 5}
    )
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 6
    assert "<|im_end|>" not in held.choices[0].text


def test_stop_strings_with_and_without_the_stop_string(client):
    kw = {"max_tokens": 20, "temperature": 0, "extra_body": {"ignore_eos": True}}
    text = complete(client, **kw).choices[0].text
    stop = text[5:8]
    cut = complete(client, stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]
    assert cut.model_extra["stop_reason"] == stop  # vLLM's field: which stop string ended it
    kept = complete(
        client, stop=[stop], **{**kw, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}}
    )
    assert kept.choices[0].text == text[: text.find(stop) + len(stop)]


def test_skip_special_tokens(client):
    start = 1  # <|im_start|>: a special token
    kw = {"max_tokens": 3, "temperature": 0, "logit_bias": {str(start): 100}}
    shown = complete(client, **kw, extra_body={"skip_special_tokens": False}).choices[0].text
    hidden = complete(client, **kw).choices[0].text
    assert shown == "<|im_start|>" * 3 and hidden == ""


# ---- structured output ------------------------------------------------------------------------------


def test_json_schema_output_parses_and_validates(client):
    schema = {
        "type": "object",
        "properties": {"capital": {"enum": ["Paris", "Rome", "Madrid"]}, "sunny": {"type": "boolean"}},
        "required": ["capital", "sunny"],
        "additionalProperties": False,
    }
    res = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "The capital of France?"}],
        max_tokens=60,
        temperature=0.7,
        seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    jsonschema.validate(json.loads(res.choices[0].message.content), schema)
    via_vllm = complete(client, max_tokens=60, seed=2, extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(via_vllm.choices[0].text), schema)


def test_json_output_is_compact_unless_the_schema_asks_for_whitespace(server, client):
    """A model that wants nothing but whitespace (biased +100) still closes the object: JSON comes out as
    json.dumps writes it. A schema with `x-guidance: whitespace_flexible` gets the whitespace it allows."""
    http = httpx.Client(headers=HEADERS, base_url=server.base)
    spaces = {
        t
        for s in ["\n", " ", "\t", "\n\n", "  ", "\r\n"]
        for t in http.post("/tokenize", json={"prompt": s, "add_special_tokens": False}).json()["tokens"]
    }
    kw = {"max_tokens": 40, "temperature": 0, "logit_bias": {str(t): 100 for t in spaces}}
    closed = {**SCHEMA, "additionalProperties": False}  # else the spaces go into extra keys' names
    compact = complete(client, **kw, extra_body={"guided_json": closed}).choices[0]
    assert compact.finish_reason == "stop" and compact.text == json.dumps(json.loads(compact.text))
    loose = complete(
        client, **kw, extra_body={"guided_json": {**closed, "x-guidance": {"whitespace_flexible": True}}}
    )
    assert loose.choices[0].finish_reason == "length" and loose.choices[0].text.strip() in ("", "{")


def test_json_object_regex_and_choice(client):
    obj = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "json please"}],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
        logit_bias={str(t): -100 for t in range(3, 60)},  # keep the random model's object short
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.lstrip().startswith("{")
    regex = complete(
        client, max_tokens=20, temperature=1.0, seed=2, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"}
    )
    assert (
        re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.choices[0].text) and regex.choices[0].finish_reason == "stop"
    )
    choices = ["Paris", "Rome", "Madrid"]
    for seed in range(3):
        res = complete(
            client, max_tokens=10, temperature=1.0, seed=seed, extra_body={"guided_choice": choices}
        )
        assert res.choices[0].text in choices


# ---- endpoints and tokenization ---------------------------------------------------------------------


def test_tokenize_detokenize_version_and_model_endpoints(server, client):
    http = httpx.Client(headers=HEADERS, base_url=server.base)
    tok = http.post(
        "/tokenize", json={"model": "tiny", "prompt": "Hello, world!", "return_token_strs": True}
    ).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] > 0
    assert http.post("/detokenize", json={"model": "tiny", "tokens": tok["tokens"]}).json() == {
        "prompt": "Hello, world!"
    }
    res = complete(client, prompt="Hello, world!", max_tokens=1)
    assert res.usage.prompt_tokens == tok["count"]
    assert http.get("/version").json()["version"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_string_and_token_id_prompts_are_the_same_request(server, client):
    ids = HTTP.post(server.base + "/tokenize", headers=HEADERS, json={"prompt": "def add(a, b):"}).json()[
        "tokens"
    ]
    kw = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    by_text = complete(client, prompt="def add(a, b):", **kw)
    by_ids = complete(client, prompt=ids, **kw)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)


def test_chat_template_options_reach_the_template(server, client):
    http = httpx.Client(headers=HEADERS, base_url=server.base)
    msgs = [{"role": "user", "content": "hi"}]

    def rendered(**kw):
        ids = http.post("/tokenize", json={"messages": msgs, **kw}).json()["tokens"]
        return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]

    assert rendered().endswith("<|im_start|>assistant\n")
    assert not rendered(add_generation_prompt=False).endswith("assistant\n")
    template = (
        "{{ greeting }}{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = rendered(chat_template=template, chat_template_kwargs={"greeting": "Howdy! "}, tools=tools)
    assert text == "Howdy! [tool get_weather]user: hi\n"
    # the same options through the chat endpoint: the prompt it counts is the one rendered above
    res = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=1,
        tools=tools,
        extra_body={"chat_template": template, "chat_template_kwargs": {"greeting": "Howdy! "}},
    )
    expected = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["count"]
    assert res.usage.prompt_tokens == expected


# ---- conformance: our responses against vLLM's documented schema, field by field ----------------------

# vLLM's response models (vllm/entrypoints/openai/protocol.py): field -> JSON type(s); "?" = may be null
USAGE = {"prompt_tokens": int, "completion_tokens": int, "total_tokens": int}
COMPLETION_LOGPROBS = {"text_offset": list, "token_logprobs": list, "tokens": list, "top_logprobs": list}
COMPLETION = {
    "id": str,
    "object": "text_completion",
    "created": int,
    "model": str,
    "choices": list,
    "usage": USAGE,
}
COMPLETION_CHOICE = {
    "index": int,
    "text": str,
    "logprobs": (COMPLETION_LOGPROBS, None),
    "finish_reason": ("stop", "length"),
    "stop_reason": (None, str, int),
}
CHAT_COMPLETION = {
    "id": str,
    "object": "chat.completion",
    "created": int,
    "model": str,
    "choices": list,
    "usage": USAGE,
}
CHAT_TOP = {"token": str, "logprob": float, "bytes": list}
CHAT_CHOICE = {
    "index": int,
    "message": {"role": "assistant", "content": str, "tool_calls": list},
    "logprobs": ({"content": list}, None),
    "finish_reason": ("stop", "length"),
    "stop_reason": (None, str, int),
}
CHAT_LOGPROB = {**CHAT_TOP, "top_logprobs": list}
COMPLETION_CHUNK = {"id": str, "object": "text_completion", "created": int, "model": str, "choices": list}
CHUNK_CHOICE = {
    "index": int,
    "text": str,
    "logprobs": (COMPLETION_LOGPROBS, None),
    "finish_reason": (None, "stop", "length"),
    "stop_reason": (None, str, int),
}
CHAT_CHUNK = {"id": str, "object": "chat.completion.chunk", "created": int, "model": str, "choices": list}
CHAT_CHUNK_CHOICE = {
    "index": int,
    "delta": dict,
    "logprobs": ({"content": list}, None),
    "finish_reason": (None, "stop", "length"),
    "stop_reason": (None, str, int),
}


def conforms(value, spec, where="") -> None:
    """Asserts `value` has exactly the shape `spec` describes (dict: every field, recursively; type;
    literal; tuple: any of)."""
    if isinstance(spec, tuple):
        errors = []
        for option in spec:
            try:
                conforms(value, option, where)
                return
            except AssertionError as e:
                errors.append(str(e))
        raise AssertionError(f"{where}: {value!r} matches none of {spec}: {errors}")
    if spec is None:
        assert value is None, f"{where}: expected null, got {value!r}"
    elif isinstance(spec, dict):
        assert isinstance(value, dict), f"{where}: expected an object, got {value!r}"
        missing = spec.keys() - value.keys()
        assert not missing, f"{where}: missing {sorted(missing)}"
        for key, sub in spec.items():
            conforms(value[key], sub, f"{where}.{key}")
    elif isinstance(spec, type):
        ok = isinstance(value, spec) and not (spec is int and isinstance(value, bool))
        assert ok or (spec is float and isinstance(value, int)), f"{where}: {value!r} is not {spec.__name__}"
    else:
        assert value == spec, f"{where}: {value!r} != {spec!r}"


def sse_events(server, path, body):
    with HTTP.stream("POST", server.base + path, json=body, headers=HEADERS, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_responses_conform_to_vllms_schema_field_by_field(server):
    res = post(server, C, {**P, "max_tokens": 4, "logprobs": 2, "n": 2, "seed": 1}).json()
    conforms(res, COMPLETION, "completion")
    for i, choice in enumerate(res["choices"]):
        conforms(choice, COMPLETION_CHOICE, f"completion.choices.{i}")
        lp = choice["logprobs"]
        assert len({len(v) for v in lp.values()}) == 1  # one entry per token in each list
    openai.types.Completion.model_validate(res)

    chat = post(server, CHAT, {**M, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}).json()
    conforms(chat, CHAT_COMPLETION, "chat")
    conforms(chat["choices"][0], CHAT_CHOICE, "chat.choices.0")
    for entry in chat["choices"][0]["logprobs"]["content"]:
        conforms(entry, CHAT_LOGPROB, "chat.logprobs")
        for top in entry["top_logprobs"]:
            conforms(top, CHAT_TOP, "chat.top_logprobs")
    openai.types.chat.ChatCompletion.model_validate(chat)


@pytest.mark.parametrize("chat", [False, True])
def test_stream_chunks_conform_and_end_with_usage(server, chat):
    base = M if chat else P
    body = {
        **base,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 2,
        "seed": 3,
    }
    events = sse_events(server, CHAT if chat else C, body)
    *chunks, last = events
    for c in chunks:
        conforms(c, CHAT_CHUNK if chat else COMPLETION_CHUNK, "chunk")
        assert c["usage"] is None  # usage only in the last chunk (stream_options.include_usage)
        for choice in c["choices"]:
            conforms(choice, CHAT_CHUNK_CHOICE if chat else CHUNK_CHOICE, "chunk.choice")
        if chat:  # (the client reads completion chunks as Completion, whose finish_reason is never null)
            openai.types.chat.ChatCompletionChunk.model_validate(c)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    conforms(last["usage"], USAGE, "usage")
    finished = [ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert sorted(finished) == [0, 1]  # each choice finishes once
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_structured_output_ends_with_its_structure_even_when_eos_is_held_back(server):
    for extra in ({"min_tokens": 5}, {"ignore_eos": True}):
        for temperature in (0, 1.0):
            body = {**P, "guided_choice": ["Paris"], "max_tokens": 10, "temperature": temperature, **extra}
            res = post(server, C, body)
            assert res.status_code == 200, res.text
            choice = res.json()["choices"][0]
            assert choice["text"] == "Paris" and choice["finish_reason"] == "stop", (extra, choice)
    assert HTTP.get(server.base + "/health").status_code == 200


def test_an_idle_keep_alive_connection_outlives_the_clients_own_idle_limit(server):
    """httpx (so the openai client) keeps an idle connection for 5 s: a server that closes it at the same
    moment races the client reusing it, and the request fails with no response. The server keeps it longer."""
    import contextlib
    import http.client
    import socket
    import time

    from spyre_runtime.entrypoints.server.launcher import KEEP_ALIVE_SECONDS

    assert KEEP_ALIVE_SECONDS > 5
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", "/v1/models", headers=HEADERS)
        first = conn.getresponse()
        assert first.status == 200 and first.getheader("connection", "keep-alive") != "close"
        first.read()
        sock = conn.sock
        time.sleep(5.5)
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):  # raised: nothing to read and not closed, still open
            assert sock.recv(1, socket.MSG_PEEK) != b"", "the server closed the idle connection"
        sock.setblocking(True)
        conn.request("GET", "/v1/models", headers=HEADERS)
        again = conn.getresponse()
        assert again.status == 200 and conn.sock is sock
        assert json.loads(again.read())["data"][0]["id"] == "tiny"
    finally:
        conn.close()
