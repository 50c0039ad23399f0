"""Hybrid (Mamba) models: tiny random Bamba and Granite 4 "H" (GraniteMoeHybrid; Mamba-2 layers beside an
attention layer) served by our engine give HF transformers' greedy tokens, with static batching and
continuous batching (chunked prefill carrying the Mamba state from chunk to chunk, mixed steps, no
interleave, preemption under block pressure), on eager and inductor (where serving compiles nothing after
warm-up); state slots are taken and given back with the requests; prefix caching is off and said so; the
memory plan counts the state; what is not served fails at start-up in one line."""

import json
import logging
import random
import re
from dataclasses import replace

import pytest
import torch
from spyre_contract.hybrid import HybridSpec
from spyre_contract.memory import ModelDims, plan_memory
from spyre_runtime.config import ConfigError, RuntimeConfig, Shape, check_memory, load_config
from spyre_runtime.engine.llm_engine import LLMEngine
from spyre_runtime.engine.state_slots import StateSlots
from spyre_runtime.sampling.params import SamplingParams
from spyre_runtime.testing.models import write_tiny_model

from tests.runtime.engine.test_continuous import run_arrivals

MAX_TOKENS = 12


ARCHES = ("bamba", "granitemoehybrid")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {arch: write_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, seed=0) for arch in ARCHES}


@pytest.fixture(scope="module")
def hybrid_model(models):
    return models["bamba"]


def workload(vocab: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, max_tokens): lengths from 1 token to several 64-token chunks, arriving while
    others decode."""
    rng = random.Random(5)
    lengths = [150, 60, 1, 90, 58, 130, 62, 23]
    return [
        (rng.randrange(0, 12), [rng.randrange(3, vocab) for _ in range(n)], rng.randrange(4, MAX_TOKENS + 1))
        for n in lengths
    ]


@pytest.fixture(scope="module")
def expected(models):
    """arch -> HF transformers' greedy tokens for each request of the workload, alone (computed once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done = {}

    def reference(arch: str):
        if arch not in done:
            hf = AutoModelForCausalLM.from_pretrained(models[arch]).float().eval()
            items = workload(len(AutoTokenizer.from_pretrained(models[arch])))
            outputs = []
            with torch.no_grad():
                for _, prompt, n in items:
                    out = hf.generate(
                        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False
                    )
                    outputs.append(out[0, len(prompt) :].tolist())
            done[arch] = items, outputs
        return done[arch]

    return reference


def cb_config(model_dir, **kw) -> RuntimeConfig:
    base = {
        "backend": "eager",
        "use_cb": True,
        "max_model_len": 256,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
        "enable_prefix_caching": False,
    }
    return RuntimeConfig(model_dir=model_dir, served_model_name="t", **(base | kw))


def static_config(model_dir, backend="eager") -> RuntimeConfig:
    shapes = (Shape(64, MAX_TOKENS, 4), Shape(192, MAX_TOKENS, 4))
    return RuntimeConfig(model_dir=model_dir, served_model_name="t", backend=backend, shapes=shapes)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize(
    ("label", "make"),
    [
        ("static", lambda d: static_config(d)),
        ("continuous, mixed steps", lambda d: cb_config(d)),
        ("continuous, no interleave", lambda d: cb_config(d, cp_interleave_steps=False)),
        ("continuous, preemption", lambda d: cb_config(d, num_kv_blocks=5)),  # scratch + 4 blocks
    ],
)
def test_greedy_tokens_equal_hf_transformers(models, expected, arch, label, make):
    items, want = expected(arch)
    engine = LLMEngine(make(models[arch]))
    assert engine.executor.mamba is not None
    assert run_arrivals(engine, items) == want, label
    sched = engine.scheduler
    if label.startswith("continuous"):
        assert sched.slots.num_free == sched.max_num_seqs  # every slot given back
        assert sched.blocks.num_used_blocks == 0 and not engine.requests
    if label == "continuous, preemption":
        assert sched.num_preemptions > 0


@pytest.mark.parametrize(("arch", "mode"), [("granitemoehybrid", "continuous"), ("bamba", "static")])
def test_inductor_serves_equal_tokens_and_compiles_nothing_after_warmup(models, expected, arch, mode):
    """Two graphs each: continuous (the mixed step's dynamic chunk, a decode of 2 rows), static (prefill and
    decode of one 64-token shape of 2 rows, so only the workload's prompts up to 64 tokens)."""
    from torch._dynamo.utils import counters

    items, want = expected(arch)
    hybrid_model = models[arch]
    if mode == "continuous":
        cfg = cb_config(hybrid_model, backend="inductor", max_num_seqs=2)
        cfg = replace(cfg, decode_batch_buckets=(2,), kv_len_buckets=(256,))
    else:
        cfg = static_config(hybrid_model, backend="inductor")
        cfg = replace(cfg, shapes=(Shape(64, MAX_TOKENS, 2),))
        short = [i for i, (_, prompt, _) in enumerate(items) if len(prompt) <= 64]
        items, want = [items[i] for i in short], [want[i] for i in short]
    engine = LLMEngine(cfg)
    engine.executor.warmup()
    warm = dict(counters["stats"])
    assert run_arrivals(engine, items) == want
    assert dict(counters["stats"]) == warm
    assert sum(counters["recompiles"].values()) == 0


def test_slots_follow_requests_and_abort_gives_the_slot_back(hybrid_model):
    engine = LLMEngine(cb_config(hybrid_model, max_num_seqs=2))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a = engine.add_request(list(range(3, 100)), params)
    b = engine.add_request(list(range(5, 20)), params)
    engine.step()
    assert {a.state_slot, b.state_slot} == {1, 2}
    engine.abort(a.request_id)
    assert a.state_slot == 0 and engine.scheduler.slots.num_free == 1
    c = engine.add_request(list(range(7, 30)), params)
    engine.step()
    assert c.state_slot == 1  # a's slot, reused; c starts from a zero state (its first chunk)
    while engine.has_work():
        engine.step()
    assert engine.scheduler.slots.num_free == 2


def test_state_slots_table():
    slots = StateSlots(3)
    assert [slots.allocate("a"), slots.allocate("b")] == [1, 2] and not slots.can_allocate()
    with pytest.raises(RuntimeError, match="no free state slot"):
        slots.allocate("c")
    slots.free("a")
    slots.free("nobody")
    assert slots.allocate("c") == 1 and slots.slot_of("b") == 2
    with pytest.raises(ValueError, match="already holds state slot 1"):
        slots.allocate("c")


@pytest.mark.parametrize("arch", ARCHES)
def test_prompt_logprobs_equal_hf(models, arch):
    """The eager pass without a cache (prompt logprobs) runs the Mamba layers statelessly."""
    from transformers import AutoModelForCausalLM

    engine = LLMEngine(cb_config(models[arch]))
    prompt = list(range(3, 60))
    with torch.no_grad():
        want = (
            AutoModelForCausalLM.from_pretrained(models[arch])
            .float()
            .eval()(torch.tensor([prompt]))
            .logits[0]
        )
    assert torch.allclose(engine.executor.score(prompt), want, atol=1e-3)


def test_start_up_says_prefix_caching_is_off_and_plans_the_state(hybrid_model, caplog):
    env = {"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_USE_CB": "1"}
    with caplog.at_level(logging.INFO):
        cfg = load_config(hybrid_model, environ=env, max_model_len=256, max_num_seqs=4)
        check_memory(cfg, environ=env)
    assert not cfg.enable_prefix_caching
    assert "hybrid (Mamba) model: prefix caching is off" in caplog.text
    spec = HybridSpec.from_model_dir(hybrid_model)
    # 3 Mamba layers x (conv 160 x 4 + ssm 4 x 32 x 16) per slot, 5 slots (scratch + 4), fp32
    assert spec.state_bytes(5, 4) == 5 * 3 * (160 * 4 + 4 * 32 * 16) * 4
    dims = ModelDims.from_config(json.loads((hybrid_model / "config.json").read_text()))
    plain = plan_memory(dims, cfg, 2**40, "host")
    assert plan_memory(dims, cfg, 2**40, "host", state_bytes=1000).kv_cache == plain.kv_cache + 1000


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"backend": "sendnn"}, "eager and inductor backends only"),
        ({"enable_prefix_caching": True}, "prefix caching off"),
    ],
)
def test_what_is_not_served_fails_at_start_up(hybrid_model, change, message):
    with pytest.raises(ConfigError, match=message):
        LLMEngine(cb_config(hybrid_model, **change))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"position_embedding_type": "rope"}, "position_embedding_type='rope' is not supported"),
        ({"mamba_n_groups": 2, "mamba_n_heads": 4}, "mamba_n_groups=2 is not supported"),
    ],
)
def test_granite_4_h_forms_not_built_are_refused_in_one_line(models, tmp_path, change, message):
    for path in models["granitemoehybrid"].iterdir():
        (tmp_path / path.name).symlink_to(path)
    config = json.loads((models["granitemoehybrid"] / "config.json").read_text()) | change
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=re.escape(message)):
        LLMEngine(cb_config(tmp_path))


def test_server_serves_concurrent_requests_as_hf_does(models, expected, tmp_path):
    """`spyre-runtime serve` on the granite-4 "H" tiny model (continuous, eager) through the openai client:
    four requests at once (one longer than a chunk) answer HF's greedy text; start-up says prefix caching
    is off."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    from tests.runtime.serverproc import ServerProcess

    items, want = expected("granitemoehybrid")
    chosen = [0, 1, 3, 7]  # 150, 60, 90 and 23 prompt tokens
    env = {"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_USE_CB": "1"}
    args = ("--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64")
    srv = ServerProcess(models["granitemoehybrid"], env, tmp_path / "server.log", extra_args=args)
    with srv.serving():
        client = srv.client()

        def complete(i):
            _, prompt, n = items[i]
            extra = {"ignore_eos": True}
            out = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=n, temperature=0, extra_body=extra
            )
            return out.choices[0].text

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(complete, chosen))
    tokenizer = AutoTokenizer.from_pretrained(models["granitemoehybrid"])
    assert texts == [tokenizer.decode(want[i]) for i in chosen]
    assert "hybrid (Mamba) model: prefix caching is off" in srv.log_path.read_text()
