"""Beam search on SmolLM2-135M-Instruct (fp32) through the server's continuous batching equals HF
transformers' beam search for the same beam width, on 8 prompts (four with a system prompt long enough
that the beams share its KV blocks through the prefix cache), over the stopping modes: the same beams, in
the same order, with the same texts and finish reasons."""

from pathlib import Path

import pytest
import torch
from spyre_runtime.testing.models import prepare_smollm2
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.runtime.serverproc import ServerProcess
from tests.runtime.test_beam_search import hf_beams

pytestmark = pytest.mark.slow

ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
    "SENDNN_INFERENCE_USE_CB": "1",
    "SENDNN_INFERENCE_DTYPE": "float32",
}
ARGS = ("--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "256")
SYSTEM = (
    "You are a careful assistant for a travel agency. Answer in one short sentence, name places precisely, "
    "and never invent prices, dates or opening hours that you were not given by the customer. If you are "
    "not sure, say so plainly and suggest where the customer could check."
)
# (question, long system prompt?, beams, length_penalty, early_stopping)
CASES = [
    ("What is the capital of France?", False, 3, 1.0, False),
    ("Write a haiku about the sea.", False, 4, 0.5, True),
    ("2 + 2 =", False, 2, 1.5, "never"),
    ("Name a color.", False, 3, 0.0, False),
    ("Where is the Eiffel Tower?", True, 3, 1.0, False),
    ("Suggest a museum in Rome.", True, 4, 1.0, True),
    ("Is Oslo in Norway?", True, 2, 2.0, False),
    ("What should I pack for Iceland?", True, 3, -0.5, "never"),
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def smollm2():
    return prepare_smollm2(Path.home() / ".cache/spyre-serve/models/smollm2")


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    srv = ServerProcess(
        smollm2, ENV, tmp_path_factory.mktemp("beam-smol") / "server.log", served_name="smol", extra_args=ARGS
    )
    with srv.serving(timeout=600):
        yield srv


def test_beams_equal_hfs_on_eight_prompts(server, smollm2):
    tok = AutoTokenizer.from_pretrained(smollm2)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    client = server.client(timeout=600)
    for question, long_system, width, length_penalty, early_stopping in CASES:
        messages = [{"role": "system", "content": SYSTEM}] if long_system else []
        messages.append({"role": "user", "content": question})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        assert (len(ids) > 64) == long_system  # a shared full block only with the long system prompt
        extra = {"use_beam_search": True, "length_penalty": length_penalty, "early_stopping": early_stopping}
        res = client.completions.create(
            model="smol", prompt=ids, max_tokens=MAX_TOKENS, n=width, extra_body=extra
        )
        rows, _ = hf_beams(hf, ids, width, MAX_TOKENS, length_penalty, early_stopping)
        eos = tok.eos_token_id
        expected = [
            (
                tok.decode(r[: r.index(eos)] if eos in r else r, skip_special_tokens=True),
                "stop" if eos in r else "length",
            )
            for r in rows
        ]
        got = [(c.text, c.finish_reason) for c in res.choices]
        assert got == expected, (question, got, expected)
        print(question, width, length_penalty, early_stopping, [t for t, _ in got])
