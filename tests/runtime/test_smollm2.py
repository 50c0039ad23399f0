"""SmolLM2-135M-Instruct (a real model, built from its PyPI wheel): greedy parity with HF transformers."""

from pathlib import Path

import pytest
import torch
from spyre_runtime.config import RuntimeConfig, Shape
from spyre_runtime.engine.llm_engine import LLMEngine
from spyre_runtime.sampling.params import SamplingParams
from spyre_runtime.testing.models import prepare_smollm2
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


@pytest.fixture(scope="module")
def hf_greedy(smollm2):
    """HF transformers' fp32 greedy tokens (stopping at EOS) for each chat prompt, and the prompts' ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS
    ]
    ids = [list(i["input_ids"]) if hasattr(i, "keys") else list(i) for i in ids]
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    expected = [
        hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :].tolist() for p in ids
    ]
    return ids, expected, hf


def served_greedy(smollm2, prompt_ids, dtype: str, kv_cache_dtype: str = "auto") -> list[list[int]]:
    """The serving path: continuous batching, inductor (frozen weights, fullgraph), 2 graphs."""
    cfg = RuntimeConfig(
        model_dir=smollm2,
        served_model_name="s",
        backend="inductor",
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        use_cb=True,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        decode_batch_buckets=(4,),
        kv_len_buckets=(128,),
    )
    engine = LLMEngine(cfg)
    engine.executor.warmup()
    reqs = [engine.add_request(i, SamplingParams(max_tokens=16, temperature=0)) for i in prompt_ids]
    while engine.has_work():
        engine.step()
    return [r.output_token_ids for r in reqs]


def test_smollm2_frozen_inductor_continuous_batching_matches_hf(smollm2, hf_greedy):
    ids, expected, _ = hf_greedy
    assert served_greedy(smollm2, ids, "float32") == expected


# bf16 keeps 8 bits of mantissa: logits near 16-32 are rounded to steps of 0.125, and the rounding of every
# layer's activations adds up, so candidates closer than three such steps in fp32 may swap (seen: a
# three-way tie 16.213 / 15.973 / 15.957 where bf16 took the third). The tolerance: a bf16 greedy sequence
# equals HF fp32's, or first differs at a step where bf16 picked a token whose fp32 logit is within
# BF16_TIE_MARGIN of fp32's best.
BF16_TIE_MARGIN = 0.375


def test_smollm2_bfloat16_greedy_matches_hf_fp32_up_to_near_ties(smollm2, hf_greedy):
    ids, expected, hf = hf_greedy
    assert near_ties_only(ids, expected, served_greedy(smollm2, ids, "bfloat16"), hf) >= 1


def test_smollm2_float32_with_a_bfloat16_kv_cache_matches_hf_up_to_near_ties(smollm2, hf_greedy):
    """--kv-cache-dtype bfloat16 under float32 weights: only K and V are rounded, so the sequences stay
    closer to HF's than all-bf16 serving does."""
    ids, expected, hf = hf_greedy
    got = served_greedy(smollm2, ids, "float32", kv_cache_dtype="bfloat16")
    assert near_ties_only(ids, expected, got, hf) >= len(ids) - 1


def near_ties_only(ids, expected, got, hf) -> int:
    """Checks that every sequence equals HF fp32's or first differs at a near-tie; returns how many equal."""
    num_exact = 0
    for prompt, exp, out in zip(ids, expected, got, strict=True):
        k = next((i for i, (a, b) in enumerate(zip(out, exp, strict=False)) if a != b), None)
        if k is None:
            assert out == exp
            num_exact += 1
            continue
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + exp])).logits[0, len(prompt) - 1 + k]
        # a near-tie: bf16 took a token whose fp32 logit is within the margin of fp32's best one
        best = logits.max()
        assert best - logits[out[k]] < BF16_TIE_MARGIN, (k, best, logits[out[k]], torch.topk(logits, 3))
    return num_exact


def test_the_wheels_gguf_converts_again_to_the_same_folder(smollm2, tmp_path):
    """The conversion itself (a fresh machine runs it once; later runs reuse the folder): with this
    environment's transformers and without `accelerate` (transformers 5.24 refused a GGUF through
    from_pretrained without it, and a fresh machine's make test then failed at every SmolLM2 test's set-up),
    the same files, byte for byte, as the folder every other test uses."""
    again = prepare_smollm2(tmp_path / "smollm2")
    names = sorted(p.name for p in smollm2.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert "model.safetensors" in names and "config.json" in names
    for name in names:
        assert (again / name).read_bytes() == (smollm2 / name).read_bytes(), name
