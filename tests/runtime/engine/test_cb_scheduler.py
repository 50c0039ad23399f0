"""Continuous-batching scheduler, with no model: step-by-step golden tables on scripted arrivals.

Each row: (step, kind, request ids in the step, tokens computed, waiting, running, KV blocks used, finished).
A fake engine appends token 7 to every request that gets a sampled token and finishes it at max_tokens.
Blocks hold 64 tokens; block 0 is scratch."""

import dataclasses
from pathlib import Path

import pytest
from spyre_runtime.config import RuntimeConfig, load_config
from spyre_runtime.engine.sched.continuous import ContinuousScheduler
from spyre_runtime.request import Request, Status
from spyre_runtime.sampling.params import SamplingParams


def config(**kw) -> RuntimeConfig:
    # the golden tables below spend the whole chunk beside decodes (mixed_prefill_tokens 0); the decode-first
    # budget has tables of its own
    base = {
        "max_model_len": 256,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
        "use_cb": True,
        "mixed_prefill_tokens": 0,
        "wave_start": False,  # the scheduler's own start of a decode (test_wave_start.py: a wave's)
    }
    return RuntimeConfig(model_dir=Path("unused"), served_model_name="t", **(base | kw))


def req(rid: str, prompt: int | list[int], max_tokens: int) -> Request:
    tokens = prompt if isinstance(prompt, list) else [1] * prompt
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0))


def drive(sched: ContinuousScheduler, arrivals: dict[int, list[Request]], num_steps: int) -> list[tuple]:
    rows = []
    for t in range(num_steps):
        for r in arrivals.get(t, []):
            sched.add(r)
        step = sched.schedule()
        if step is None:
            rows.append(
                (t, "idle", (), 0, sched.num_waiting, sched.num_running, sched.blocks.num_used_blocks, ())
            )
            continue
        for r in step.requests:
            r.output_token_ids.append(7)
            if r.num_output_tokens >= r.sampling.max_tokens:
                r.finish("length")
        done = sched.update(step)
        ids = tuple(row.request for row in step.decode) + step.scheduled
        kind = "prefill" if step.is_prefill else "decode"
        rows.append(
            (
                t,
                "mixed" if step.is_prefill and step.decode else kind,
                tuple(r.request_id for r in ids),
                step.num_tokens,
                sched.num_waiting,
                sched.num_running,
                sched.blocks.num_used_blocks,
                tuple(r.request_id for r in done),
            )
        )
    return rows


def test_requests_join_and_leave_the_running_batch():
    s = ContinuousScheduler(config())
    a, b = req("a", 100, 3), req("b", 30, 4)
    rows = drive(s, {0: [a], 1: [b]}, 7)
    assert rows == [
        (0, "prefill", ("a",), 64, 0, 1, 2, ()),  # a's first chunk; a holds 2 blocks (100 tokens)
        (1, "prefill", ("a", "b"), 64, 0, 2, 3, ()),  # a's last 36 tokens and b's first 28 in one chunk
        (2, "mixed", ("a", "b"), 3, 0, 2, 3, ()),  # b's last 2 tokens beside a's first decode
        (3, "decode", ("a", "b"), 2, 0, 1, 1, ("a",)),  # a leaves at once, its blocks freed...
        (4, "decode", ("b",), 1, 0, 1, 1, ()),  # ...b goes on alone
        (5, "decode", ("b",), 1, 0, 0, 0, ("b",)),
        (6, "idle", (), 0, 0, 0, 0, ()),
    ]
    assert [a.num_output_tokens, b.num_output_tokens] == [3, 4]


def test_long_prompt_chunks_run_beside_the_decodes_only_when_interleaving():
    def run(interleave: bool) -> list[str]:
        s = ContinuousScheduler(config(cp_interleave_steps=interleave))
        rows = drive(s, {0: [req("a", 10, 8)], 2: [req("long", 200, 2)]}, 9)
        return [f"{kind[0]}{''.join(ids)}" for _, kind, ids, *_ in rows]

    # chunks of 64, 64, 64, 8 tokens for the 200-token prompt, each in one step with a's decode: a streams
    # on while the prompt arrives, and the last chunk gives long its first token
    assert run(True) == ["pa", "da", "malong", "malong", "malong", "malong", "dalong", "da", "i"]
    # without: the whole prompt first; long (max_tokens 2) then decodes once beside a and leaves
    assert run(False) == ["pa", "da", "plong", "plong", "plong", "plong", "dalong", "da", "da"]


def test_max_num_seqs_holds_back_admission_until_a_request_leaves():
    s = ContinuousScheduler(config(max_num_seqs=2))
    rows = drive(s, {0: [req("a", 10, 3), req("b", 10, 4), req("c", 10, 1)]}, 7)
    assert [
        (kind[0], ids, waiting, running, done) for _, kind, ids, _, waiting, running, _, done in rows
    ] == [
        ("p", ("a", "b"), 1, 2, ()),  # both prompts in one chunk; two running: c waits
        ("d", ("a", "b"), 1, 2, ()),
        ("d", ("a", "b"), 1, 1, ("a",)),
        ("m", ("b", "c"), 0, 0, ("b", "c")),  # a left, c is admitted (and done: max_tokens 1)
        ("i", (), 0, 0, ()),
        ("i", (), 0, 0, ()),
        ("i", (), 0, 0, ()),
    ]


def test_prefix_cache_hit_skips_computed_blocks_and_eviction_keeps_counts():
    s = ContinuousScheduler(config())
    shared = list(range(10, 138))  # 128 tokens: two whole blocks
    first, second = req("first", [*shared, 1, 2, 3], 1), req("second", [*shared, 4, 5], 1)
    rows = drive(s, {0: [first], 4: [second]}, 6)
    assert [(kind[0], ids, n, used) for _, kind, ids, n, _, _, used, _ in rows] == [
        ("p", ("first",), 64, 3),
        ("p", ("first",), 64, 3),
        ("p", ("first",), 3, 0),  # finished with its prefill token; its two full blocks stay cached
        ("i", (), 0, 0),
        ("p", ("second",), 2, 0),  # 128 tokens hit: only the 2 new tokens are computed
        ("i", (), 0, 0),
    ]
    assert s.num_cached_tokens == 128
    cold = ContinuousScheduler(config(enable_prefix_caching=False))
    rows = drive(cold, {0: [req("first", [*shared, 1], 1)], 3: [req("second", [*shared, 4, 5], 1)]}, 6)
    assert [n for _, kind, _, n, *_ in rows if kind == "prefill"] == [64, 64, 1, 64, 64, 2]


def test_block_pressure_preempts_the_newest_request_and_resumes_it_without_loss():
    # scratch + 4 blocks. a and b hold 2 blocks each (120-token prompts); when a grows past 128 tokens it
    # needs a third block, so b (the newest) is preempted, and resumed once a has finished: b re-prefills
    # prompt + its 8 tokens (128), of which the first prompt block is still in the prefix cache.
    s = ContinuousScheduler(config(num_kv_blocks=5, max_num_batched_tokens=128))
    a, b = req("a", list(range(3, 123)), 12), req("b", list(range(200, 320)), 12)
    rows = drive(s, {0: [a, b]}, 18)
    assert [row[1:] for row in rows] == [
        ("prefill", ("a", "b"), 128, 0, 2, 4, ()),  # a's prompt and b's first 8 tokens
        ("mixed", ("a", "b"), 113, 0, 2, 4, ()),  # a's decode, b's last 112 tokens
        *[("decode", ("a", "b"), 2, 0, 2, 4, ())] * 7,
        ("decode", ("a",), 1, 1, 1, 3, ()),  # b preempted: back to waiting, its blocks freed
        ("decode", ("a",), 1, 1, 1, 3, ()),
        ("decode", ("a",), 1, 1, 0, 0, ("a",)),
        ("prefill", ("b",), 64, 0, 1, 2, ()),  # 128 tokens, 64 of them hit the cache
        ("decode", ("b",), 1, 0, 1, 3, ()),
        ("decode", ("b",), 1, 0, 1, 3, ()),
        ("decode", ("b",), 1, 0, 0, 0, ("b",)),
        ("idle", (), 0, 0, 0, 0, ()),
        ("idle", (), 0, 0, 0, 0, ()),
    ]
    assert (s.num_preemptions, a.num_preemptions, b.num_preemptions) == (1, 0, 1)
    assert a.num_output_tokens == b.num_output_tokens == 12 and not s.has_work()


def test_abort_frees_blocks_wherever_the_request_is():
    s = ContinuousScheduler(config(max_num_seqs=2))
    a, b, c = req("a", 100, 5), req("b", 10, 5), req("c", 10, 5)
    for r in (a, b, c):
        s.add(r)
    s.update(s.schedule())  # a's first chunk (the whole budget): a holds 2 blocks mid-prefill, b 1, c waits
    assert (s.blocks.num_used_blocks, s.num_running, s.num_waiting) == (3, 2, 1)
    assert s.abort("a") is a and a.finish_reason == "abort" and s.blocks.num_used_blocks == 1
    assert s.abort("c") is c and s.num_waiting == 0 and s.blocks.num_used_blocks == 1
    step = s.schedule()
    assert step.scheduled == (b,) and step.chunks[0].start == 0
    assert s.abort("missing") is None


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "ok"), [(200, 56, True), (200, 57, False), (256, 1, False), (1, 255, True)]
)
def test_admission_limit_is_prompt_plus_max_tokens(prompt, max_tokens, ok):
    s = ContinuousScheduler(config())
    assert s.can_admit(prompt, max_tokens) is ok
    if not ok:
        with pytest.raises(ValueError, match=r"prompt tokens \+ max_tokens must be at most 256"):
            s.add(req("x", prompt, max_tokens))
    assert s.max_tokens_for(prompt) == 256 - prompt


def test_buckets_pick_the_smallest_compiled_shape():
    s = ContinuousScheduler(config(max_num_seqs=8))
    reqs = [req(f"r{i}", 70 if i == 0 else 10, 4) for i in range(3)]
    for r in reqs:
        s.add(r)
    steps = []
    while s.has_work():
        step = s.schedule()
        steps.append(step)
        for r in step.requests:
            r.output_token_ids.append(7)
            if r.num_output_tokens >= r.sampling.max_tokens:
                r.finish("length")
        s.update(step)
    chunk_sizes = [st.chunk_size for st in steps if st.is_prefill]
    decodes = [(len(st.decode), st.batch_size, st.kv_len) for st in steps if not st.is_prefill]
    # 64 tokens of the 70-token prompt, then its last 6 and both 10-token prompts in one chunk (23 tokens
    # beside the pieces' last ones)
    assert chunk_sizes == [64, 64]
    assert [len(c.token_ids) for c in steps[1].chunks] == [6, 10, 10]
    assert decodes[0] == (3, 4, 128)  # all three prefilled first; 71 tokens -> KV bucket 128
    assert (3, 4, 128) in decodes and all(b in (1, 2, 4, 8) for _, b, _ in decodes)
    assert all(r.status is Status.FINISHED for r in reqs)


def test_a_mixed_step_prefills_pieces_of_at_most_four_prompts_within_the_token_budget():
    s = ContinuousScheduler(config(max_num_seqs=8))
    assert s.pieces == 4
    rows = drive(s, {0: [req(f"r{i}", 30 if i == 0 else 10, 3) for i in range(6)]}, 3)
    assert [
        (kind[0], "".join(ids), n, waiting, running) for _, kind, ids, n, waiting, running, *_ in rows
    ] == [
        ("p", "r0r1r2r3", 60, 0, 6),  # four pieces (30 + 3 x 10 tokens), all six admitted
        ("m", "r0r1r2r3r4r5", 24, 0, 6),  # the four decode beside the last two prompts
        ("d", "r0r1r2r3r4r5", 6, 0, 2),
    ]
    budget = ContinuousScheduler(config(max_num_seqs=8))
    for i in range(3):
        budget.add(req(f"b{i}", 50, 2))
    step = budget.schedule()  # 50 + the first 14 of the next prompt fill the 64-token budget
    assert [(c.request.request_id, c.start, len(c.token_ids), c.is_last) for c in step.chunks] == [
        ("b0", 0, 50, True),
        ("b1", 0, 14, False),
    ]
    assert step.chunk_size == 64 and step.requests == (step.chunks[0].request,)


def test_decode_first_budget_bounds_the_prompt_tokens_beside_running_decodes():
    """With requests decoding, a mixed step carries at most `mixed_prefill_tokens` prompt tokens (a running
    stream's gap stays near a decode step); with nothing decoding a step takes the whole chunk."""
    s = ContinuousScheduler(config(mixed_prefill_tokens=16))
    a, b = req("a", 100, 10), req("b", 40, 3)
    rows = drive(s, {0: [a], 2: [b]}, 9)
    assert [row[1:4] for row in rows] == [
        ("prefill", ("a",), 64),  # nothing decodes: the whole chunk
        ("prefill", ("a",), 36),  # a's last 36 tokens, still nothing decoding
        ("mixed", ("a", "b"), 17),  # a decodes: b gets 16 prompt tokens beside it
        ("mixed", ("a", "b"), 17),
        ("mixed", ("a", "b"), 9),  # b's last 8 tokens
        ("decode", ("a", "b"), 2),
        ("decode", ("a", "b"), 2),
        ("decode", ("a",), 1),  # b finished (3 tokens)
        ("decode", ("a",), 1),
    ]


@pytest.mark.parametrize(("budget", "expected"), [(0, 64), (16, 16), (500, 64)])
def test_decode_first_budget_is_capped_by_the_chunk(budget, expected):
    assert ContinuousScheduler(config(mixed_prefill_tokens=budget)).mixed_budget == expected


def test_prefill_pieces_setting_bounds_the_prompts_of_one_mixed_step(tiny_model):
    """SENDNN_INFERENCE_CB_PREFILL_PIECES: a mixed step prefills pieces of at most that many prompts (never
    more than max_num_seqs), the same number the executor lays out places for."""
    env = {"SENDNN_INFERENCE_USE_CB": "1", "SENDNN_INFERENCE_CB_PREFILL_PIECES": "2"}
    cfg = load_config(tiny_model, environ=env, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64)
    assert cfg.prefill_pieces == 2
    s = ContinuousScheduler(dataclasses.replace(cfg, mixed_prefill_tokens=0))
    rows = drive(s, {0: [req("a", 8, 4), req("b", 8, 4), req("c", 8, 4)]}, 2)
    # a and b, prefilled, wait for c: by default a wave's prompts start decoding together
    assert [row[1:4] for row in rows] == [("prefill", ("a", "b"), 16), ("prefill", ("c",), 8)]
    assert (
        load_config(tiny_model, environ=env | {"SENDNN_INFERENCE_CB_PREFILL_PIECES": "9"}).prefill_pieces == 4
    )
