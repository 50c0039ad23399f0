"""Continuous batching on a real FMS model: greedy outputs of a mixed workload are token-identical to each
request run alone (static batching, batch 1), with and without prefix caching, and under block pressure with
preemption; with inductor, serving after warmup compiles nothing."""

import random
from dataclasses import replace

import pytest
from spyre_runtime.config import RuntimeConfig, Shape
from spyre_runtime.engine.llm_engine import LLMEngine
from spyre_runtime.sampling.params import SamplingParams

MAX_TOKENS = 24


def cb_config(model_dir, **kw) -> RuntimeConfig:
    base = {
        "backend": "eager",
        "use_cb": True,
        "max_model_len": 256,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
    }
    return RuntimeConfig(model_dir=model_dir, served_model_name="t", **(base | kw))


def workload(vocab: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, max_tokens): varied lengths, several prompts longer than one chunk, and a
    group sharing a 128-token prefix."""
    rng = random.Random(7)
    shared = [rng.randrange(3, vocab) for _ in range(128)]
    items = []
    for i in range(8):
        n = rng.randrange(4, 170)
        items.append(
            (rng.randrange(0, 30), [rng.randrange(3, vocab) for _ in range(n)], rng.randrange(4, MAX_TOKENS))
        )
        if i % 2:
            tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]
            items.append((rng.randrange(0, 60), shared + tail, MAX_TOKENS))
    return items


def run_arrivals(engine, items) -> list[list[int]]:
    reqs = {}
    step = 0
    while len(reqs) < len(items) or engine.has_work():
        for i, (at, prompt, max_tokens) in enumerate(items):
            if at == step:
                params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
                reqs[i] = engine.add_request(prompt, params)
        engine.step()
        step += 1
    return [reqs[i].output_token_ids for i in range(len(items))]


@pytest.fixture(scope="module")
def alone(tiny_model):
    """Each request run alone, with static batching at batch size 1."""
    engine = LLMEngine(
        RuntimeConfig(
            model_dir=tiny_model, served_model_name="t", backend="eager", shapes=(Shape(192, MAX_TOKENS, 1),)
        )
    )
    items = workload(len(engine.tokenizer))
    outputs = []
    for _, prompt, max_tokens in items:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        r = engine.add_request(prompt, params)
        while engine.has_work():
            engine.step()
        outputs.append(r.output_token_ids)
    return items, outputs


@pytest.mark.parametrize(
    ("label", "overrides"),
    [
        ("prefix caching", {}),
        ("no prefix caching", {"enable_prefix_caching": False}),
        ("no interleave", {"cp_interleave_steps": False}),
        ("block pressure", {"num_kv_blocks": 6}),  # scratch + 5 blocks: preemption is certain
    ],
)
def test_mixed_workload_matches_each_request_alone(tiny_model, alone, label, overrides):
    items, expected = alone
    engine = LLMEngine(cb_config(tiny_model, **overrides))
    assert run_arrivals(engine, items) == expected, label
    sched = engine.scheduler
    assert sched.blocks.num_used_blocks == 0 and not engine.requests
    if label == "prefix caching":
        assert sched.num_cached_tokens >= 128 * 3  # the shared-prefix group hit the cache
    if label == "no prefix caching":
        assert sched.num_cached_tokens == 0
    if label == "block pressure":
        assert sched.num_preemptions > 0


def test_inductor_serving_compiles_nothing_after_warmup(tiny_model, alone):
    from torch._dynamo.utils import counters

    cfg = cb_config(tiny_model, backend="inductor", max_num_seqs=3)
    engine = LLMEngine(replace(cfg, decode_batch_buckets=(1, 3), kv_len_buckets=(128, 256)))
    engine.executor.warmup()
    warm = dict(counters["stats"])
    items, expected = alone
    assert run_arrivals(engine, items) == expected
    sampled = [
        engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=1))
        for _, p, _ in items[:4]
    ]
    while engine.has_work():
        engine.step()
    assert all(r.num_output_tokens >= 1 for r in sampled)
    assert dict(counters["stats"]) == warm
    assert sum(counters["recompiles"].values()) == 0
