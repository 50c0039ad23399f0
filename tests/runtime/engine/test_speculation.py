"""N-gram speculation (SENDNN_INFERENCE_CB_NGRAM_SPEC_TOKENS): the proposer and the acceptance as plain
functions, the scheduler's draft rows, and through the real engine (the tiny model, eager) the same greedy
tokens with speculation on as off, in fewer steps."""

import random
from pathlib import Path

import pytest
import torch
from spyre_runtime.config import load_config
from spyre_runtime.engine.llm_engine import LLMEngine
from spyre_runtime.engine.sched.speculation import accepted, propose, speculable
from spyre_runtime.request import Request
from spyre_runtime.sampling.params import SamplingParams
from spyre_runtime.sampling.sampler import sample
from spyre_runtime.steps import DecodeRow
from spyre_runtime.testing.models import prepare_smollm2
from transformers import AutoTokenizer

from tests.httpclient import HTTP
from tests.runtime.engine.test_cb_scheduler import config
from tests.runtime.entrypoints.test_metrics import CB_ARGS, CB_ENV
from tests.runtime.serverproc import ServerProcess
from tests.runtime.vllm_reference import sample as metric
from tests.runtime.vllm_reference import vllm_families

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        ([1, 2, 3, 9, 9, 1, 2, 3], 3, [9, 9, 1]),  # the 3-gram's earlier occurrence and what followed it
        ([1, 2, 3, 4, 5, 6, 2, 3], 2, [4, 5]),  # the 2-gram
        ([5, 1, 2, 7, 1, 2, 8, 1, 2], 1, [8]),  # the latest occurrence first
        ([5, 1, 2, 7, 8, 9, 1, 2, 1, 2], 3, [7, 8, 9]),  # the latest one that k tokens follow
        ([4, 4, 4, 4, 4], 3, [4]),  # the longest suffix that occurred, though shorter ones have more after
        ([1, 2, 3, 4, 5], 3, []),  # nothing repeats
        ([1, 2, 1, 2], 0, []),  # no drafts asked
        ([7], 3, []),
        ([], 3, []),
        ([70000, 1, 70000, 1], 2, [70000, 1]),  # ids above 2^16 (4 bytes a token)
    ],
)
def test_propose(tokens, k, expected):
    assert propose(tokens, k) == expected


def reference(tokens, k):
    for n in range(min(4, len(tokens) - 1), 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
        follows = [tokens[s + n : s + n + k] for s in starts]
        if follows:
            full = [f for f in follows if len(f) == k]
            return full[-1] if full else max(follows, key=len)
    return []


def test_propose_equals_a_plain_search_on_random_sequences():
    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([(0, 3), (255, 258), (65535, 65538), (0, 70000)])
        tokens = [rng.randint(*vocab) for _ in range(rng.randint(0, 30))]
        k = rng.randint(0, 5)
        assert propose(tokens, k) == (reference(tokens, k) if k else []), (tokens, k)


def test_a_draft_is_kept_while_every_draft_before_it_matched():
    a, b = Request("a", [1], GREEDY), Request("b", [2], GREEDY)
    rows = [
        DecodeRow(a, 10, 5, (1,)),
        DecodeRow(a, 11, 6, (1,), draft=True),  # sampled before it: 11, kept
        DecodeRow(a, 12, 7, (1,), draft=True),  # sampled before it: 99, rejected
        DecodeRow(a, 13, 8, (1,), draft=True),  # after a rejected draft: rejected, though it matches
        DecodeRow(b, 20, 3, (2,)),
        DecodeRow(b, 21, 4, (2,), draft=True),  # sampled before it: 22, rejected
    ]
    tokens = [11, 99, 12, 14, 22, 23, 30]  # the last: a prefilled prompt's first token
    requests = [row.request for row in rows] + [Request("c", [3], GREEDY)]
    assert list(accepted(requests, rows, tokens)) == [0, 1, 4, 6]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({}, True),
        ({"temperature": 0.7}, True),  # drawn with its drafts (the sampler's speculative draw)
        ({"temperature": 0.7, "seed": 1}, False),  # its own generator's draws stay the same
        ({"logprobs": 2}, False),
        ({"repetition_penalty": 1.2}, False),
        ({"logit_bias": {5: 1.0}}, False),
        ({"min_tokens": 3}, False),  # its EOS is still banned for the next rows
    ],
)
def test_only_a_request_whose_next_token_depends_on_the_logits_alone_speculates(change, expected):
    params = SamplingParams(**({"max_tokens": 10, "temperature": 0} | change))
    req = Request("r", [1, 2, 3], params)
    req.output_token_ids.append(4)
    assert speculable(req) is expected


def scheduler(spec: int, **overrides):
    from spyre_runtime.engine.sched.continuous import ContinuousScheduler

    return ContinuousScheduler(config(ngram_spec_tokens=spec, **overrides))


def decode_after_prefill(sched, prompts, params=GREEDY):
    reqs = [Request(f"r{i}", list(p), params) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    while sched.prefilling or sched.waiting:
        step = sched.schedule()
        for req in step.requests:
            req.output_token_ids.append(req.all_token_ids()[-3])
        sched.update(step)
    return reqs, sched.schedule()


def test_drafts_follow_their_row_and_fill_only_the_free_rows():
    """Buckets 2 and 4: two running requests leave two rows for drafts, the first request takes both."""
    sched = scheduler(3, max_num_seqs=2, decode_batch_buckets=(2, 4))
    _, step = decode_after_prefill(sched, [[5, 6, 7, 5, 6], [8, 9, 1, 2, 3]])
    # r0: prompt 5 6 7 5 6 and its first token 7 -> "5 6 7" occurred before, followed by 5 6 7 (two rows left)
    assert [(row.request.request_id, row.token_id, row.position, row.draft) for row in step.decode] == [
        ("r0", 7, 5, False),
        ("r0", 5, 6, True),
        ("r0", 6, 7, True),
        ("r1", 1, 5, False),  # r1's first token, 1: no n-gram of "2 3 1" occurred before
    ]
    assert step.batch_size == 4 and sched.num_draft_tokens == 2
    table = sched.blocks.block_table("r0")
    assert all(row.block_table == table for row in step.decode[:3])


def test_no_drafts_when_off_when_the_batch_is_full_or_the_request_is_nearly_done():
    prompt, two = [5, 6, 7, 5, 6], {"max_num_seqs": 2}
    for sched, params in (
        (scheduler(0, decode_batch_buckets=(2, 4), **two), GREEDY),  # off
        (scheduler(3, decode_batch_buckets=(2,), **two), GREEDY),  # no free row
        (scheduler(3, decode_batch_buckets=(2, 4), **two), SamplingParams(max_tokens=2, temperature=0)),
        (scheduler(3, decode_batch_buckets=(2, 4), max_batch_tkv_limit=4096, **two), GREEDY),  # Spyre's
    ):
        _, step = decode_after_prefill(sched, [prompt, [8, 9, 1, 2, 3]], params)
        assert not any(row.draft for row in step.decode) and len(step.decode) == 2


def run_engine(model, spec: int, prompts, params, buckets="4,16"):
    env = {
        "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
        "SENDNN_INFERENCE_USE_CB": "1",
        "SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES": buckets,
        "SENDNN_INFERENCE_CB_NGRAM_SPEC_TOKENS": str(spec),
    }
    engine = LLMEngine(load_config(model, environ=env, max_num_seqs=4, max_model_len=256))
    try:
        engine.executor.warmup()
        reqs = [engine.add_request(p, params[i % len(params)]) for i, p in enumerate(prompts)]
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        return reqs, steps, engine
    finally:
        engine.close()


def check_same_tokens_fewer_steps(off, on):
    """The same tokens and finish reasons; each kept draft is a token that came in the step of the token
    before it, so it spared a step of its request."""
    (off_reqs, off_steps, _), (on_reqs, on_steps, engine) = off, on
    assert [r.output_token_ids for r in on_reqs] == [r.output_token_ids for r in off_reqs]
    assert [r.finish_reason for r in on_reqs] == [r.finish_reason for r in off_reqs]
    kept = engine.num_accepted_tokens
    assert 0 < kept <= engine.scheduler.num_draft_tokens
    assert sum(len(r.token_times) - len(set(r.token_times)) for r in on_reqs) == kept
    assert all(len(set(r.token_times)) == len(r.token_times) for r in off_reqs)
    assert on_steps <= off_steps
    return kept, on_steps, off_steps


PROMPTS = [[(3 * i + j % (5 + i)) % 120 + 1 for j in range(30 + 7 * i)] for i in range(4)]


def test_the_engine_gets_the_same_greedy_tokens_with_speculation(tiny_model):
    """Greedy requests (one with a stop token id, one with max_tokens 7) beside a sampled one, which does not
    speculate (the tiny model's random weights repeat little, so few drafts are kept)."""
    params = [
        GREEDY,
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(17,), ignore_eos=True),
    ]
    off, on = (run_engine(tiny_model, spec, PROMPTS, params) for spec in (0, 3))
    check_same_tokens_fewer_steps(off, on)
    assert len(on[0][1].output_token_ids) == 7 and on[0][1].finish_reason == "length"


def test_smollm2_keeps_most_drafts_of_a_repeating_continuation():
    """SmolLM2 (eager) continues lists of words by repeating them: the same greedy tokens, most drafts kept,
    fewer steps. Two streams in the 8-row bucket leave 6 rows for drafts."""
    model = prepare_smollm2(Path.home() / ".cache/spyre-serve/models/smollm2")
    words = ["cloud", "card", "compile", "shape", "batch", "token", "model", "serve", "queue", "graph"]
    prompts = [" ".join(words[i : i + 5] * 4) for i in range(2)]
    tok = AutoTokenizer.from_pretrained(model)
    ids = [tok(p)["input_ids"] for p in prompts]
    params = [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)]
    off, on = (run_engine(model, spec, ids, params, buckets="2,8") for spec in (0, 3))
    kept, on_steps, off_steps = check_same_tokens_fewer_steps(off, on)
    assert kept >= 32  # of 62 tokens after the first ones
    assert on_steps <= off_steps - 16
    # sampled (temperature 0.3, no seed): the sampler draws each row with the draft the next row checks
    sampled = [SamplingParams(max_tokens=32, temperature=0.3, ignore_eos=True)]
    reqs, steps, engine = run_engine(model, 3, ids, sampled, buckets="2,8")
    assert [len(r.output_token_ids) for r in reqs] == [32, 32] and steps < off_steps
    assert 0 < engine.num_accepted_tokens <= engine.scheduler.num_draft_tokens


def test_a_server_counts_its_drafts_as_vllm_does(tiny_model, tmp_path):
    """`vllm:spec_decode_num_draft_tokens` and `..._accepted_tokens` (vLLM's names and labels) count a
    greedy request's drafts; a server without speculation has neither family."""
    env = CB_ENV | {
        "SENDNN_INFERENCE_CB_DECODE_BATCH_SIZES": "2,8",
        "SENDNN_INFERENCE_CB_NGRAM_SPEC_TOKENS": "3",
    }
    body = {"model": "tiny", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with ServerProcess(tiny_model, env, tmp_path / "spec.log", extra_args=CB_ARGS).serving() as srv:
        for prompt in PROMPTS:  # the tiny model repeats little: some of its 2-grams come back in 40 tokens
            out = HTTP.post(srv.base + "/v1/completions", json=body | {"prompt": prompt}, timeout=120).json()
            assert out["usage"]["completion_tokens"] == 40
        text = HTTP.get(srv.base + "/metrics", timeout=10).text
    families = vllm_families(text)
    for name in ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens"):
        kind, labels, _ = families[name]
        assert kind == "counter" and labels == {"model_name", "engine"}
    drafts = metric(text, "vllm:spec_decode_num_draft_tokens_total", model_name="tiny")
    kept = metric(text, "vllm:spec_decode_num_accepted_tokens_total", model_name="tiny")
    assert drafts > 0 and 0 <= kept <= drafts
    env["SENDNN_INFERENCE_CB_NGRAM_SPEC_TOKENS"] = "0"
    with ServerProcess(tiny_model, env, tmp_path / "off.log", extra_args=CB_ARGS).serving() as srv:
        text = HTTP.get(srv.base + "/metrics", timeout=10).text
    assert not any(name.startswith("vllm:spec_decode") for name in vllm_families(text))


@pytest.mark.parametrize(
    ("draft", "top_k"),
    [(1, 0), (0, 0), (3, 0), (3, 2)],  # likely, most likely, unlikely, and cut by top_k (probability 0)
)
def test_a_row_with_a_draft_draws_from_the_same_distribution(draft, top_k):
    """Speculative sampling with a certain draft: over 20,000 rows the tokens' frequencies are the
    distribution's (softmax of the logits at temperature 1, after top_k), within 1.5 percentage points,
    and the draft is kept exactly when it is drawn."""
    torch.manual_seed(0)
    n = 20000
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[None].repeat(n, 1)
    rows = [Request(f"r{i}", [1], SamplingParams(temperature=1.0, top_k=top_k)) for i in range(n)]
    out = sample(logits, rows, [draft] * n)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).double() / n
    expected = torch.tensor([0.5, 0.3, 0.15, 0.05]) if not top_k else torch.tensor([0.625, 0.375, 0.0, 0.0])
    assert torch.allclose(freq, expected.double(), atol=0.015), freq
    plain = sample(logits, rows)  # no drafts: the same distribution
    plain_freq = torch.bincount(torch.tensor(plain.token_ids), minlength=4).double() / n
    assert torch.allclose(plain_freq, expected.double(), atol=0.015)


def test_a_rejected_drafts_block_goes_back_so_no_newer_request_is_preempted():
    """Five blocks: a's drafts take the last free block, all are rejected and a stops on its third token;
    b, newer, needs a third block a step later. Without giving the draft's block back, b was preempted."""
    sched = scheduler(
        3, max_num_seqs=2, decode_batch_buckets=(2, 8), num_kv_blocks=5, max_num_batched_tokens=256
    )
    a = Request(
        "a", [5, 6, 7, 8, 9, 10, *range(1000, 1053), 5, 6], SamplingParams(max_tokens=20, temperature=0)
    )
    b = Request("b", list(range(2000, 2127)), SamplingParams(max_tokens=20, temperature=0))
    sched.add(a)
    sched.add(b)
    firsts, later, drafted = {"a": 7, "b": 3000}, iter(range(4000, 5000)), 0
    while (step := sched.schedule()) is not None:
        drafted += sum(row.draft for row in step.decode)
        for i, req in enumerate(step.requests):
            if i < len(step.decode) and step.decode[i].draft:
                continue  # the model disagrees with every draft
            req.output_token_ids.append(firsts.pop(req.request_id, None) or next(later))
            if req is a and req.num_output_tokens == 3:
                req.finish("stop")
            elif req.num_output_tokens == 20:
                req.finish("length")
        sched.update(step)
        assert all(
            len(t) <= -(-r.num_tokens // 64)
            for r in sched.running
            for t in [sched.blocks.tables[r.request_id]]
        )
    assert drafted > 0 and sched.num_preemptions == 0 and b.num_output_tokens == 20


def test_static_batching_turns_speculation_off(tiny_model):
    env = {"SENDNN_INFERENCE_USE_CB": "0", "SENDNN_INFERENCE_CB_NGRAM_SPEC_TOKENS": "3"}
    assert load_config(tiny_model, environ=env).ngram_spec_tokens == 0


def test_the_gaps_between_tokens_are_between_steps():
    """Kept drafts come in their row's step: one gap a step, as vLLM records one a request and iteration."""
    from spyre_runtime.engine.outputs import RequestTimings

    timings = RequestTimings(0.0, 0.1, 0.2, 1.0, (0.2, 0.25, 0.25, 0.25, 0.4, 0.4))
    assert [round(g, 6) for g in timings.itl_seconds] == [0.05, 0.15]


def test_a_client_that_hangs_up_mid_speculation_frees_every_block():
    """An abort (the server's, when a client disconnects) of a request whose step carried drafts frees its
    grown block table at once, and so does the other's."""
    sched = scheduler(3, max_num_seqs=2, decode_batch_buckets=(2, 8))
    free_before = sched.blocks.num_free_blocks
    reqs, step = decode_after_prefill(sched, [[5, 6, 7, 5, 6], [8, 9, 1, 2, 3]])
    assert any(row.draft for row in step.decode)
    aborted = sched.abort("r0")
    assert aborted is reqs[0] and aborted.finish_reason == "abort"
    sched.abort("r1")
    assert sched.blocks.num_free_blocks == free_before and not sched.has_work()
