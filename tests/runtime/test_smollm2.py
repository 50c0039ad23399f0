"""SmolLM2-135M-Instruct (a real model, built from its PyPI wheel): greedy parity with HF transformers."""

from pathlib import Path

import pytest
import torch
from spyre_runtime.config import RuntimeConfig, Shape
from spyre_runtime.engine import LLMEngine
from spyre_runtime.models import prepare_smollm2
from spyre_runtime.sampling import SamplingParams
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "2 + 2 ="]


@pytest.fixture(scope="module")
def smollm2():
    return prepare_smollm2(Path.home() / ".cache/spyre-serve/models/smollm2")


def test_smollm2_greedy_matches_hf(smollm2):
    cfg = RuntimeConfig(model_dir=smollm2, served_model_name="s", backend="eager", shapes=(Shape(64, 16, 4),))
    engine = LLMEngine(cfg)
    engine.executor.warmup()
    tok = engine.tokenizer
    ids = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS
    ]
    ids = [list(i["input_ids"]) if hasattr(i, "keys") else list(i) for i in ids]
    params = SamplingParams(max_tokens=10, temperature=0)  # stops at EOS, as HF generate does
    batched = [engine.add_request(i, params) for i in ids]
    while engine.has_work():
        engine.step()
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    for req, prompt_ids in zip(batched, ids, strict=True):
        expected = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=10, do_sample=False)
        assert req.output_token_ids == expected[0, len(prompt_ids) :].tolist()
    answer = tok.decode(batched[0].output_token_ids, skip_special_tokens=True)
    assert "Paris" in answer
