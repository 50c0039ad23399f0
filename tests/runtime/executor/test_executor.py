"""The executor against HF transformers on the same weights: greedy outputs are token-identical, for single
prompts and padded batches of mixed lengths; with inductor, serving after warmup compiles nothing."""

import subprocess
import sys

import pytest
import torch
from spyre_runtime.config import RuntimeConfig, Shape
from spyre_runtime.engine.llm_engine import LLMEngine
from spyre_runtime.sampling.params import SamplingParams
from spyre_runtime.testing.models import write_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "The capital of France",
    "Hello, world! How are you today? I am fine, thank you. What is the answer?",
    "def add(a, b):",
    "Kubernetes reconciles",
    "1 2 3",
]


def hf_greedy(model_dir, prompt_ids, max_new_tokens):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[0, len(prompt_ids) :].tolist()


def run_engine(engine, prompts_ids, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(ids, params) for ids in prompts_ids]
    while engine.has_work():
        engine.step()
    return [r.output_token_ids for r in reqs]


def make_engine(model_dir, backend, shapes):
    cfg = RuntimeConfig(
        model_dir=model_dir, served_model_name="t", backend=backend, shapes=shapes, max_model_len=256
    )
    engine = LLMEngine(cfg)
    engine.executor.warmup()
    return engine


@pytest.fixture(scope="module")
def granite_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-granite"), arch="granite", seed=1)


@pytest.mark.parametrize("arch", ["llama", "granite"])
def test_greedy_matches_hf_single_and_padded_batches(arch, tiny_model, granite_model):
    model_dir = tiny_model if arch == "llama" else granite_model
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert len({len(i) for i in ids}) > 1  # mixed lengths: the batch is really left-padded
    expected = [hf_greedy(model_dir, i, 12) for i in ids]
    single = make_engine(model_dir, "eager", (Shape(64, 16, 1),))
    assert [run_engine(single, [i], 12)[0] for i in ids] == expected
    batched = make_engine(model_dir, "eager", (Shape(64, 16, 4), Shape(128, 16, 2)))
    assert run_engine(batched, ids, 12) == expected


def test_inductor_serving_compiles_nothing_after_warmup(tiny_model):
    from torch._dynamo.utils import counters

    shapes = (Shape(64, 16, 1), Shape(64, 16, 4), Shape(128, 32, 2))
    engine = make_engine(tiny_model, "inductor", shapes)
    warm = dict(counters["stats"])
    assert warm["unique_graphs"] >= 2 * len(shapes) - 0  # prefill + decode per shape were compiled
    tok = engine.tokenizer
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    long_prompt = tok(" ".join(PROMPTS * 3))["input_ids"][:100]
    # a varied workload: single, batched, long prompts, different max_tokens, sampling
    run_engine(engine, ids[:1], 5)
    run_engine(engine, ids, 16)
    run_engine(engine, [long_prompt, ids[2]], 30)
    sampled = [
        engine.add_request(i, SamplingParams(max_tokens=7, temperature=0.8, top_k=20, seed=3)) for i in ids
    ]
    while engine.has_work():
        engine.step()
    assert all(r.num_output_tokens >= 1 for r in sampled)
    assert dict(counters["stats"]) == warm
    assert counters["recompiles"] == {} or sum(counters["recompiles"].values()) == 0


def test_seeded_sampling_is_reproducible(tiny_model):
    engine = make_engine(tiny_model, "eager", (Shape(64, 16, 4),))
    ids = engine.tokenizer(PROMPTS[0])["input_ids"]

    def run(seed):
        r = engine.add_request(
            ids, SamplingParams(max_tokens=10, temperature=1.0, seed=seed, ignore_eos=True)
        )
        while engine.has_work():
            engine.step()
        return r.output_token_ids

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_loading_imports_no_hf_adapter_and_the_whole_package_imports_after(tiny_model):
    """FMS's HF loading runs with `fms.models.hf` bare (loader.without_hf_adapters): a fresh process loads the
    model without FMS's HF adapters or transformers' modeling code (2.2 s of CPU a process); the package
    imports whole afterwards and FMS's own hf_pretrained loading gives the same model."""
    script = f"""
import sys, torch
from pathlib import Path
from spyre_runtime.executor.families.rooms import load_fms_model
model = load_fms_model(Path({str(tiny_model)!r}))
heavy = ("fms.models.hf", "fms.models.hf.utils", "transformers.modeling_utils")
print([m for m in heavy if m in sys.modules])
import fms.models.hf
from fms.models import get_model
whole = get_model("hf_pretrained", model_path={str(tiny_model)!r}, data_type=torch.float32).eval()
ids = torch.arange(12).unsqueeze(0)
print(hasattr(fms.models.hf, "_causal_lm_models"), torch.equal(model(ids), whole(ids)))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "True True"], done.stdout
