"""A reasoning model whose `</think>` closes, through a server (issue 37): the tiny model rewired so that its
greedy output is a known text (each token's successor is fixed: attention and MLP outputs zeroed, the head
mapping a token's embedding to the next token), served with `--reasoning-parser deepseek_r1` and continuous
batching. The chat API splits reasoning from content, whole and streamed; the Responses API gives a
reasoning item, and its usage counts the reasoning's tokens and the prefix cache's hits."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.runtime.serverproc import ServerProcess

REASONING, ANSWER = "Sum up.", "Four!"  # every token distinct, so one successor each
ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
    "SENDNN_INFERENCE_USE_CB": "1",
    "SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES": "1",
    "SENDNN_INFERENCE_CB_KV_LENS": "256",
}
ARGS = ("--max-model-len", "256", "--max-num-seqs", "1", "--max-num-batched-tokens", "64")
ARGS += ("--reasoning-parser", "deepseek_r1")
BLOCK = 64


def write_forced_model(tiny: Path, into: Path, text: str) -> list[int]:
    """A copy of `tiny` whose greedy output after any chat prompt is `text`, then EOS. Returns the output's
    token ids. The hidden state is the last token's embedding alone, so the head picks its successor."""
    from transformers import AutoTokenizer

    shutil.copytree(tiny, into)
    tok = AutoTokenizer.from_pretrained(into)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    chain = [tok(prompt, add_special_tokens=False)["input_ids"][-1], *ids, tok.eos_token_id]
    assert len(set(chain[:-1])) == len(chain) - 1, "a token with two successors"
    weights = load_file(into / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    embed, norm = weights["model.embed_tokens.weight"], weights["model.norm.weight"]
    head = torch.zeros_like(weights["lm_head.weight"])
    for token, successor in itertools.pairwise(chain):
        h = embed[token] * torch.rsqrt(embed[token].pow(2).mean() + 1e-5) * norm
        head[successor] += 30 * h / h.norm()
    weights["lm_head.weight"] = head
    save_file(weights, into / "model.safetensors", metadata={"format": "pt"})
    return ids


@pytest.fixture(scope="module")
def forced(tiny_model, tmp_path_factory):
    into = tmp_path_factory.mktemp("forced") / "model"
    return into, write_forced_model(tiny_model, into, f"{REASONING}</think>{ANSWER}")


@pytest.fixture(scope="module")
def server(forced, tmp_path_factory):
    log = tmp_path_factory.mktemp("reasoning-server") / "server.log"
    srv = ServerProcess(forced[0], ENV, log, extra_args=ARGS)
    with srv.serving():
        yield srv


def reasoning_token_count(forced) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(forced[0])
    return len(tok(f"{REASONING}</think>", add_special_tokens=False)["input_ids"])


def test_chat_splits_reasoning_that_closes_whole_and_streamed(server):
    client = server.client(timeout=600)
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 40}
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "stop"
    assert (choice.message.reasoning_content, choice.message.content) == (REASONING, ANSWER)
    reasoning, content = [], []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
            content.append(c.delta.content or "")
    assert ("".join(reasoning), "".join(content)) == (REASONING, ANSWER)
    hidden = client.chat.completions.create(**kw, extra_body={"include_reasoning": False}).choices[0]
    assert (hidden.message.reasoning_content, hidden.message.content) == (None, ANSWER)


def test_responses_reasoning_item_and_its_token_count(server, forced):
    client = server.client(timeout=600)
    res = client.responses.create(model="tiny", input="2 + 2?", max_output_tokens=40)
    assert res.status == "completed"
    reasoning, message = res.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == [REASONING]
    assert message.type == "message" and res.output_text == ANSWER
    assert res.usage.output_tokens == len(forced[1]) + 1  # and EOS
    assert res.usage.output_tokens_details.reasoning_tokens == reasoning_token_count(forced)

    events = list(client.responses.create(model="tiny", input="2 + 2?", max_output_tokens=40, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == REASONING
    done = next(e for e in events if e.type == "response.completed").response
    assert done.usage.output_tokens_details.reasoning_tokens == reasoning_token_count(forced)
    assert done.output_text == ANSWER


def test_responses_usage_counts_prefix_cache_hits(server):
    client = server.client(timeout=600)
    text = "Tell me about the weather in Paris in the spring and in the autumn, please, briefly. " * 2
    first = client.responses.create(model="tiny", input=text, max_output_tokens=40).usage
    second = client.responses.create(model="tiny", input=text, max_output_tokens=40).usage
    assert first.input_tokens == second.input_tokens > BLOCK
    assert first.input_tokens_details.cached_tokens == 0
    cached = second.input_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK == 0 and cached < second.input_tokens, cached
