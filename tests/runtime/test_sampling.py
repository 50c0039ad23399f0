"""The batched sampler on real Request objects: every processor against a per-row reference, seeded rows
independent of their batch, the top_p fallback, logprobs, and the parameter rules."""

import math
import threading

import pytest
import torch
from spyre_runtime.request import Request
from spyre_runtime.sampling.params import SamplingParams
from spyre_runtime.sampling.sampler import (
    CDF_BLOCK,
    _scratch_copy,
    _top_p,
    apply_logit_processors,
    inverse_cdf,
    sample,
)


def req(i=0, prompt=(1, 2, 3), output=(), **kw):
    r = Request(f"r{i}", list(prompt), SamplingParams(**kw))
    r.output_token_ids = list(output)
    return r


def logits_of(rows, vocab=1000, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    out = sample(logits, [req(0, temperature=0), req(1, temperature=0)])
    assert out.token_ids == [1, 0] and out.logprobs == [None, None]
    # 16-bit logits are compared in float32: the same first maximum, ties included
    wide = logits_of(8, vocab=49152).to(torch.bfloat16)
    wide[3, [7, 40000]] = wide[3].max() + 1
    rows = [req(i, temperature=0) for i in range(8)]
    for dtype in (torch.bfloat16, torch.float16):
        assert sample(wide.to(dtype), rows).token_ids == wide.to(dtype).argmax(-1).tolist()
    assert sample(wide, rows).token_ids[3] == 7


def test_tiny_temperatures_are_greedy_or_raised_as_vllm_does():
    assert SamplingParams(temperature=1e-40).is_greedy
    assert SamplingParams(temperature=0.005).temperature == 0.01
    assert SamplingParams(temperature=0.5).temperature == 0.5
    logits = logits_of(2)
    # 1e-40 used to overflow the softmax; now it is argmax
    assert sample(logits, [req(0, temperature=1e-40), req(1, temperature=1e-40)]).token_ids == (
        logits.argmax(-1).tolist()
    )


def test_a_seeded_row_draws_the_same_tokens_whatever_its_batch():
    logits = logits_of(4)

    def draws(rows, which, steps=20):
        return [sample(logits, rows).token_ids[which] for _ in range(steps)]

    alone = draws([req(0, seed=7)] + [req(i, temperature=0) for i in (1, 2, 3)], 0)
    mixed = draws([req(0, seed=7), req(1, seed=9, top_k=3), req(2), req(3, top_p=0.5)], 0)
    other = draws([req(0, seed=8)] + [req(i, temperature=0) for i in (1, 2, 3)], 0)
    assert alone == mixed and alone != other


def test_steps_share_the_samplers_memory_and_nothing_of_one_step_reaches_the_next():
    """The float32 rows live in memory kept between steps (no fresh 6 MB per step for glibc to hand back and
    fault in again): the same buffer while the rows fit, a larger one when they do not. A seeded row draws
    the same tokens after larger, smaller and 16-bit steps as in a fresh thread, and the caller's logits are
    left as they were."""
    first = _scratch_copy(logits_of(8))
    assert _scratch_copy(logits_of(3, seed=1)).data_ptr() == first.data_ptr()  # fits: the same memory
    grown = _scratch_copy(logits_of(16, seed=2))
    assert grown.shape == (16, 1000) and torch.equal(grown, logits_of(16, seed=2))
    assert _scratch_copy(logits_of(8, seed=3)).data_ptr() == grown.data_ptr()
    assert _scratch_copy(logits_of(2, vocab=7)).shape == (2, 7)  # another vocabulary: its own memory

    logits = logits_of(4, seed=5)
    before = logits.clone()

    def draws() -> list[list[int]]:  # new requests each time: their generators start from their seeds
        rows = [req(0, seed=7), req(1, temperature=0), req(2, seed=3, top_p=0.8), req(3, seed=4, min_p=0.1)]
        return [sample(logits, rows).token_ids for _ in range(5)]

    fresh: list = []
    worker = threading.Thread(target=lambda: fresh.extend(draws()))  # a thread with nothing kept yet
    worker.start()
    worker.join()
    sample(logits_of(32, seed=6), [req(i, temperature=1.5) for i in range(32)])  # a larger step first
    sample(logits_of(2, seed=8).to(torch.bfloat16), [req(i) for i in range(2)])  # a smaller, 16-bit one
    assert draws() == fresh and torch.equal(logits, before)


def test_draws_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    row = req(0, seed=1)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sample(logits, [row]).token_ids[0]] += 1
    expected = torch.softmax(logits[0], -1) * 4000
    assert torch.all((counts - expected).abs() < 5 * expected.sqrt() + 5), (counts, expected)


@pytest.mark.parametrize("vocab", [49152, 1000, CDF_BLOCK, 7, 3 * CDF_BLOCK + 1])
def test_the_two_level_inverse_cdf_picks_what_one_cumulative_sum_picks(vocab):
    gen = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(64, vocab, generator=gen) * 4, dim=-1)
    probs[16:32] *= torch.rand(16, vocab, generator=gen) < 0.02  # sparse rows, as after top_k / top_p
    probs[16:32, 0] += 1e-3  # every row keeps some mass
    probs[32, :-1] = 0.0  # the mass in the last token only
    probs[33, 1:] = 0.0  # in the first only
    uniform = torch.rand(64, generator=gen, dtype=torch.float64)
    uniform[40:48] = 1 - 2**-53  # the largest uniform below 1
    uniform[48:52] = 0.0
    cdf = probs.double().cumsum(dim=-1)
    expected = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True).clamp(max=vocab - 1)[:, 0]
    picked = inverse_cdf(probs, uniform)
    assert picked.tolist() == expected.tolist()
    assert bool((probs.gather(1, picked[:, None]) > 0).all())
    # a row without mass (the softmax of a row whose every token is masked) gets the last token, as one
    # cumulative sum clamped to the vocabulary gave
    probs[5] = float("nan")
    assert inverse_cdf(probs, uniform)[5] == vocab - 1


def test_top_k_top_p_min_p_restrict_each_row_to_its_own_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, -10.0, -10.0]] * 4)
    rows = [
        req(0, seed=0, top_k=2),
        req(1, seed=1, top_p=0.5),
        req(2, seed=2, top_p=0.95),
        req(3, seed=3, min_p=0.3),
    ]
    seen = [set() for _ in rows]
    for _ in range(400):
        for i, t in enumerate(sample(logits, rows).token_ids):
            seen[i].add(t)
    # probabilities ~ .66 .24 .09: top_p 0.5 keeps only the first; min_p 0.3 keeps p >= .2
    assert seen == [{0, 1}, {0}, {0, 1, 2}, {0, 1}]


def test_top_p_bisects_the_whole_row_when_the_top_candidates_hold_too_little_mass():
    slope = torch.linspace(2.0, 1.0, 1000)[torch.randperm(1000, generator=torch.Generator().manual_seed(0))]
    flat = (slope / slope.sum())[None]  # the top 256 of 1000 hold ~30% of the mass: the bisection path
    peaked = torch.softmax(torch.tensor([10.0, 9.0] + [0.0] * 998), -1)[None]
    probs = torch.cat([flat, flat, peaked])
    _top_p(probs, torch.tensor([0.9, 1.0, 0.9]))
    kept = (probs > 0).sum(-1).tolist()
    cumulative = flat[0].sort(descending=True).values.cumsum(0)
    expected = int((cumulative < 0.9).sum()) + 1  # the smallest prefix reaching 0.9
    assert kept == [expected, 1000, 2] and 800 < expected < 900


def reference_penalties(logits, r):
    """vLLM's rules, written per row and per token."""
    p = r.sampling
    out = logits.clone()
    counts = {t: r.output_token_ids.count(t) for t in set(r.output_token_ids)}
    for t in set(r.prompt_token_ids) | set(counts):
        x = out[t]
        out[t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for t, c in counts.items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def test_penalties_bias_and_min_tokens_match_a_per_row_reference():
    logits = logits_of(3, vocab=50)
    rows = [
        req(
            0,
            prompt=(1, 2),
            output=(3, 3, 4),
            repetition_penalty=1.5,
            frequency_penalty=0.7,
            presence_penalty=0.3,
        ),
        req(1, prompt=(5,), output=(5, 6), presence_penalty=-1.0, logit_bias=((7, 5.0), (8, -100.0))),
        req(2, output=(9,), min_tokens=3, stop_token_ids=(11,), eos_token_ids=(10,)),
    ]
    got = logits.clone()
    apply_logit_processors(got, rows, [r.sampling for r in rows])
    assert torch.allclose(got[0], reference_penalties(logits[0], rows[0]))
    expected1 = reference_penalties(logits[1], rows[1])
    expected1[7] += 5.0
    expected1[8] -= 100.0
    assert torch.allclose(got[1], expected1)
    assert got[2, 10] == -math.inf and got[2, 11] == -math.inf
    assert torch.equal(got[2, :10], logits[2, :10])
    # once min_tokens is reached the stop tokens are allowed again
    rows[2].output_token_ids = [9, 9, 9]
    again = logits.clone()
    apply_logit_processors(again, rows[2:], [rows[2].sampling])
    assert torch.equal(again[0], logits[0])


def test_logit_bias_and_min_tokens_steer_greedy_rows():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    assert sample(logits, [req(temperature=0, logit_bias=((2, 10.0),))]).token_ids == [2]
    assert sample(logits, [req(temperature=0, min_tokens=1, eos_token_ids=(0,))]).token_ids == [1]


def test_logprobs_are_the_raw_log_softmax_with_rank_and_top():
    logits = logits_of(2, vocab=100)
    rows = [req(0, temperature=0, logprobs=3), req(1, seed=3, temperature=2.0, logprobs=0)]
    out = sample(logits, rows)
    ref = torch.log_softmax(logits, -1)
    for i, lp in enumerate(out.logprobs):
        t = out.token_ids[i]
        assert lp.token_id == t and lp.logprob == pytest.approx(ref[i, t].item(), abs=1e-5)
        assert lp.rank == int((ref[i] > ref[i, t]).sum()) + 1
    top = out.logprobs[0].top
    assert [t for t, _ in top] == ref[0].topk(3).indices.tolist() and out.logprobs[0].rank == 1
    assert out.logprobs[1].top == ()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": ((1, 1000.0),)}, "logit_bias"),
        ({"seed": 2**64}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ],
)
def test_bad_params_name_the_parameter(kwargs, param):
    with pytest.raises(ValueError, match=param) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
