"""A wave's prompts start decoding together (SENDNN_INFERENCE_CB_WAVE_START): golden scheduler tables of a
wave split over several steps, and the invariants under random arrivals, block pressure and full slots.

A prompt whose prefill ends while others of its wave still prefill or wait for it sends its first token and
sits out the decode steps until they are prefilled too, so the wave decodes in one step and its streams stay
in step, and no stream's first token waits for the whole wave. Rows as in test_waves.py: (step, decoded,
prefilled (tokens), chunk length, finished)."""

import random

import pytest
from spyre_runtime.config import load_config
from spyre_runtime.engine.sched.factory import make_scheduler
from spyre_runtime.request import Request
from spyre_runtime.sampling.params import SamplingParams

from tests.runtime.engine.test_waves import config, drive, req, wave


def test_a_wave_split_over_steps_sends_first_tokens_early_and_decodes_together():
    """4 prompts of 50 tokens on an idle server, a 128-token chunk. Off: a and b decode while c and d
    prefill, and finish a step before them. On: a and b send their first token at step 0 as before, then
    wait one step; the four decode from step 2 and finish together, as early as c and d did off."""
    off, _ = drive(make_scheduler(config()), {0: wave(4, 50, 4)}, 5)
    on, _ = drive(make_scheduler(config(wave_start=True)), {0: wave(4, 50, 4)}, 5)
    assert off[1:] == [
        (1, ("a", "b"), ("c22", "d50"), 128, ()),
        (2, ("a", "b", "c", "d"), (), 0, ()),
        (3, ("a", "b", "c", "d"), (), 0, ("a", "b")),
        (4, ("c", "d"), (), 0, ("c", "d")),
    ]
    assert on == [
        (0, (), ("a50", "b50", "c28"), 128, ()),  # a and b get their first token here, as off
        (1, (), ("c22", "d50"), 128, ()),  # a and b wait for c and d
        (2, ("a", "b", "c", "d"), (), 0, ()),
        (3, ("a", "b", "c", "d"), (), 0, ()),
        (4, ("a", "b", "c", "d"), (), 0, ("a", "b", "c", "d")),  # off: c and d finished here, a and b at 3
    ]


def test_running_streams_keep_decoding_while_a_wave_waits():
    """Two streams decode; a wave of 3 prompts of 60 tokens arrives at step 2 and takes two steps. x and y
    decode in every step; a and b, prefilled at step 2, wait for c, and the wave decodes from step 4."""
    arrivals = {0: [req("x", 20, 12), req("y", 20, 12)], 2: wave(3, 60, 3)}
    rows, _ = drive(make_scheduler(config(backend="sendnn", wave_start=True)), arrivals, 7)
    assert rows[2:] == [
        (2, ("x", "y"), ("a60", "b60", "c8"), 128, ()),
        (3, ("x", "y"), ("c52",), 64, ()),
        (4, ("x", "y", "a", "b", "c"), (), 0, ()),
        (5, ("x", "y", "a", "b", "c"), (), 0, ("a", "b", "c")),
        (6, ("x", "y"), (), 0, ()),
    ]


def test_the_wave_is_what_the_free_slots_hold_not_the_whole_queue():
    """2 sequence slots, 3 prompts of 100 tokens, pieces of one prompt a step: a waits only for b (c has no
    slot, it is the next wave's); with a and b decoding, c waits for a slot."""
    s = make_scheduler(config(max_num_seqs=2, max_prefill_pieces=1, wave_start=True))
    prompts = [
        Request(rid, [k + 2] * 100, SamplingParams(max_tokens=2, temperature=0))
        for k, rid in enumerate("abc")
    ]
    rows, _ = drive(s, {0: prompts}, 6)
    assert rows == [
        (0, (), ("a100",), 128, ()),
        (1, (), ("b100",), 128, ()),  # a waits for b
        (2, ("a", "b"), (), 0, ("a", "b")),
        (3, (), ("c100",), 128, ()),  # c alone: nothing to wait for
        (4, ("c",), (), 0, ("c",)),
        (5, (), (), 0, ()),
    ]


def test_a_request_finished_by_its_first_token_leaves_at_once_and_an_abort_frees_a_held_one():
    s = make_scheduler(config(wave_start=True))
    one, held, rest = req("one", 50, 1), req("held", 50, 4), req("rest", 100, 4)
    for r in (one, held, rest):
        s.add(r)
    step = s.schedule()
    assert [len(c.token_ids) for c in step.chunks] == [50, 50, 28]
    for r in (one, held):
        r.output_token_ids.append(7)
    one.finish("length")
    assert s.update(step) == [one]  # left at once, not held
    assert list(s.held) == [held] and s.num_running == 2
    used = s.blocks.num_used_blocks
    assert s.abort("held") is held and not s.held and s.blocks.num_used_blocks < used
    assert s.num_running == 1


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


def sampling(rng: random.Random) -> SamplingParams:
    return SamplingParams(max_tokens=rng.randint(1, 80), temperature=0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("pieces", "num_blocks"), [(1, 0), (2, 8), (4, 10)])
def test_every_request_finishes_under_pressure_and_waits_are_bounded(seed, pieces, num_blocks):
    """Random waves onto 4 slots, pieces of 1-4 prompts, a block pool small enough to preempt: every
    schedule() with work left runs a step (no held request waits on what cannot start), at most
    max_num_seqs hold blocks, a request is held a few steps at most, and every request finishes."""
    rng = random.Random(seed)
    arrivals = {
        t: [
            Request(f"r{t}-{i}", [rng.randint(1, 500) for _ in range(rng.randint(8, 150))], sampling(rng))
            for i in range(rng.randint(1, 5))
        ]
        for t in range(0, 60, 5)
    }
    kw = {"num_kv_blocks": num_blocks} if num_blocks else {}
    s = make_scheduler(config(max_num_seqs=4, max_prefill_pieces=pieces, wave_start=True, **kw))
    held_for: dict[str, int] = {}
    for t in range(1000):
        for r in arrivals.get(t, []):
            s.add(r)
        step = s.schedule()
        assert (step is None) == (not s.has_work()), f"step {t}: work left but nothing ran"
        if step is None:
            continue
        assert s.num_running <= 4
        for r in step.requests:
            r.output_token_ids.append(7)
            if r.num_output_tokens >= r.sampling.max_tokens:
                r.finish("length")
        s.update(step)
        for r in s.held:
            held_for[r.request_id] = held_for.get(r.request_id, 0) + 1
    everyone = [r for v in arrivals.values() for r in v]
    assert all(r.is_finished and r.num_output_tokens == r.sampling.max_tokens for r in everyone)
    assert not s.has_work() and not s.held and s.blocks.num_used_blocks == 0
    assert held_for and max(held_for.values()) <= 8
    assert (s.num_preemptions > 0) == bool(num_blocks)  # the small pools preempt


@pytest.mark.parametrize(("value", "on"), [(None, True), ("0", False), ("off", False), ("1", True)])
def test_the_setting_reaches_the_scheduler(tiny_model, value, on):
    """SENDNN_INFERENCE_CB_WAVE_START, on by default (bench/README.md runs 44 and 45)."""
    env = {"SENDNN_INFERENCE_USE_CB": "1"} | ({"SENDNN_INFERENCE_CB_WAVE_START": value} if value else {})
    s = make_scheduler(load_config(tiny_model, environ=env, max_num_seqs=4, max_num_batched_tokens=64))
    s.add(req("a", 60, 3))
    s.add(req("b", 60, 3))
    step = s.schedule()
    assert [len(c.token_ids) for c in step.chunks] == [60, 4]
    step.chunks[0].request.output_token_ids.append(7)
    s.update(step)
    assert (list(s.held), [r.request_id for r in s.running]) == (
        ([step.chunks[0].request], []) if on else ([], ["a"])
    )


def test_a_prompt_prefilled_alone_does_not_wait_for_prompts_that_arrived_after_its_prefill():
    """a is prefilled alone; 3 long prompts arrive after its prefill ended (the next wave): a decodes beside
    their prefill as it would without the setting. Prompts that arrived while a was prefilling (the engine
    adds them at the next step) are its wave."""
    s = make_scheduler(config(max_num_seqs=8, wave_start=True))
    a, late = req("a", 20, 6), [req(f"l{i}", 300, 2) for i in range(3)]
    for r in late:
        r.arrival_time = a.arrival_time + 3600  # after a's prefill ended
    rows, _ = drive(s, {0: [a], 1: late}, 4)
    assert [row[1] for row in rows] == [(), ("a",), ("a",), ("a",)]
    s = make_scheduler(config(max_num_seqs=8, wave_start=True))
    early = [req(f"l{i}", 300, 2) for i in range(3)]  # created (arrived) before a's prefill ended
    for r in early:
        r.arrival_time = a.arrival_time
    a = req("a", 20, 6)
    rows, _ = drive(s, {0: [a], 1: early}, 4)
    assert [row[1] for row in rows] == [(), (), (), ()]  # a waits for its wave's 900 prompt tokens


def test_a_held_request_is_preempted_as_the_newest_and_not_held_again_when_it_resumes():
    """A 4-block pool (block 0 is scratch). r0 and r1 (61 tokens) decode; h and p (10 tokens) arrive together;
    h is prefilled first and held for p. When r0 and r1 each need a second block, h (held, the newest
    started) goes first and then r1, exactly as without the setting; resumed with its first token, h's
    stream already runs, so it is not held again (p still waits)."""

    def run(on: bool) -> tuple[list, dict]:
        cfg = config(
            max_num_seqs=4, num_kv_blocks=4, max_prefill_pieces=2, mixed_prefill_tokens=8, wave_start=on
        )
        reqs = [
            Request(rid, [k + 2] * n, greedy(12))
            for k, (rid, n) in enumerate(zip("rshp", (61, 61, 10, 10), strict=True))
        ]
        rows, _ = drive(make_scheduler(cfg), {0: reqs[:2], 2: reqs[2:]}, 16)
        return rows, {r.request_id: r.num_preemptions for r in reqs}

    (off, off_preempted), (on, on_preempted) = run(False), run(True)
    assert on[3] == (3, ("r", "s"), ("h2",), 64, ())  # h's first token; held, it is not in step 4's rows
    assert on_preempted == off_preempted == {"r": 0, "s": 1, "h": 1, "p": 0}
    assert on[4:] == off[4:]  # from the preemption on, the same steps: h resumed decodes at once
