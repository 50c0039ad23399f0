"""Waves kept whole (engine/sched/waves.py, SENDNN_INFERENCE_CB_STEP_BUDGET_MS): golden scheduler tables of
a wave of prompts arriving together, with the policy off (the token-count scheduler) and on.

Each row: (step, request ids decoded, request ids prefilled (their tokens), the chunk length the step runs
at, finished). A fake engine appends token 7 to every request that gets a sampled token and finishes it at
max_tokens. The cost model of these tables: 10 ms a step, 1 ms a chunk token, 2 ms a decode row."""

import itertools
from pathlib import Path

import pytest
from spyre_runtime.config import RuntimeConfig, load_config
from spyre_runtime.engine.sched.continuous import ContinuousScheduler
from spyre_runtime.engine.sched.factory import make_scheduler
from spyre_runtime.engine.sched.volume import step_fits
from spyre_runtime.engine.sched.waves import StepCost, WaveScheduler, chunk_limit, wave_pieces
from spyre_runtime.request import Request
from spyre_runtime.sampling.params import SamplingParams

COST = (10_000, 1_000, 2_000)


def config(**kw) -> RuntimeConfig:
    base = {
        "max_model_len": 512,
        "max_num_seqs": 6,
        "max_num_batched_tokens": 128,
        "max_prefill_pieces": 4,
        "use_cb": True,
        "mixed_prefill_tokens": 0,
        "step_cost_us": COST,
        "wave_start": False,  # the scheduler's own start of a decode (test_wave_start.py: a wave's)
    }
    return RuntimeConfig(model_dir=Path("unused"), served_model_name="t", **(base | kw))


def req(rid: str, prompt: int, max_tokens: int) -> Request:
    return Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens, temperature=0))


def drive(sched: ContinuousScheduler, arrivals: dict[int, list[Request]], num_steps: int):
    """The table's rows, and every step (for the invariants)."""
    rows, steps = [], []
    for t in range(num_steps):
        for r in arrivals.get(t, []):
            sched.add(r)
        step = sched.schedule()
        if step is None:
            rows.append((t, (), (), 0, ()))
            continue
        steps.append((step, sched.num_running))
        decoded = tuple(row.request.request_id for row in step.decode)
        prefilled = tuple(f"{c.request.request_id}{len(c.token_ids)}" for c in step.chunks)
        for r in step.requests:
            r.output_token_ids.append(7)
            if r.num_output_tokens >= r.sampling.max_tokens:
                r.finish("length")
        done = sched.update(step)
        rows.append((t, decoded, prefilled, step.chunk_size, tuple(r.request_id for r in done)))
    return rows, steps


def wave(n: int, prompt: int, max_tokens: int) -> list[Request]:
    return [req(chr(ord("a") + i), prompt, max_tokens) for i in range(n)]


def test_a_wave_on_an_idle_server_finishes_its_prompts_together():
    """4 prompts of 50 tokens arrive together; a 128-token chunk holds 2.5 of them. Off: the first two finish
    a step early, decode while the others prefill, and finish a step before them (the wave splits in two).
    On: every prompt's last token waits for the others; the wave decodes and finishes as one."""
    off, _ = drive(make_scheduler(config()), {0: wave(4, 50, 4)}, 5)
    assert off == [
        (0, (), ("a50", "b50", "c28"), 128, ()),
        (1, ("a", "b"), ("c22", "d50"), 128, ()),  # a and b decode beside c's and d's prompts
        (2, ("a", "b", "c", "d"), (), 0, ()),
        (3, ("a", "b", "c", "d"), (), 0, ("a", "b")),
        (4, ("c", "d"), (), 0, ("c", "d")),  # a step behind
    ]
    on, _ = drive(make_scheduler(config(step_budget_ms=100)), {0: wave(4, 50, 4)}, 5)
    assert on == [
        (0, (), ("a49", "b49", "c33", "d1"), 128, ()),  # the whole chunk, nobody's last token
        (1, (), ("a1", "b1", "c17", "d49"), 64, ()),  # the wave's rest: no extra step
        (2, ("a", "b", "c", "d"), (), 0, ()),
        (3, ("a", "b", "c", "d"), (), 0, ()),
        (4, ("a", "b", "c", "d"), (), 0, ("a", "b", "c", "d")),
    ]


def two_running() -> dict[int, list[Request]]:
    return {0: [req("x", 20, 12), req("y", 20, 12)], 2: wave(3, 60, 3)}


@pytest.mark.parametrize(
    ("backend", "budget", "expected"),
    [
        (  # off: x and y wait 142 ms (10 + 128 + 2 x 2) for a token; a and b finish a step before c
            "sendnn",
            0,
            [
                (2, ("x", "y"), ("a60", "b60", "c8"), 128, ()),
                (3, ("x", "y", "a", "b"), ("c52",), 64, ()),
                (4, ("x", "y", "a", "b", "c"), (), 0, ("a", "b")),
                (5, ("x", "y", "c"), (), 0, ("c",)),
            ],
        ),
        (  # 100 ms beside 2 rows: 86 tokens, the 64-token bucket (78 ms); the wave finishes together
            "sendnn",
            100,
            [
                (2, ("x", "y"), ("a59", "b7", "c1"), 64, ()),
                (3, ("x", "y"), ("b52", "c14"), 64, ()),
                (4, ("x", "y"), ("a1", "b1", "c45"), 64, ()),
                (5, ("x", "y", "a", "b", "c"), (), 0, ()),
            ],
        ),
        (  # dynamic chunks (CPU): 80 tokens, a multiple of 8 (94 ms)
            "eager",
            100,
            [
                (2, ("x", "y"), ("a59", "b23", "c1"), 80, ()),
                (3, ("x", "y"), ("b36", "c46"), 80, ()),
                (4, ("x", "y"), ("a1", "b1", "c13"), 16, ()),
                (5, ("x", "y", "a", "b", "c"), (), 0, ()),
            ],
        ),
    ],
)
def test_a_wave_beside_running_streams_keeps_their_steps_within_the_budget(backend, budget, expected):
    """Two streams decode; a wave of 3 prompts of 60 tokens arrives at step 2."""
    rows, _ = drive(make_scheduler(config(backend=backend, step_budget_ms=budget)), two_running(), 6)
    assert rows[:2] == [
        (0, (), ("x20", "y20"), 64 if backend == "sendnn" else 40, ()),
        (1, ("x", "y"), (), 0, ()),
    ]
    assert rows[2:] == expected


def arrivals() -> dict[int, list[Request]]:
    """Waves of mixed sizes onto a busy server: 3 long-running streams, then waves of 4 every 6 steps."""
    out = {0: [req(f"r{i}", 30 + 20 * i, 40) for i in range(3)]}
    for t in (2, 8, 14, 20):
        out[t] = [req(f"w{t}-{i}", 40 + 37 * i, 6 + i) for i in range(4)]
    return out


@pytest.mark.parametrize("backend", ["sendnn", "eager"])
@pytest.mark.parametrize("budget", [40, 100, 250])
@pytest.mark.parametrize("tkv_limit", [0, 2048])
def test_the_budget_holds_and_the_limits_still_hold(backend, budget, tkv_limit):
    """Every step with decode rows keeps within the budget (when the smallest chunk beside its rows fits
    it), every running stream decodes in every step (no pausing below the limit: its wait is one step),
    at most max_num_seqs sequences run, the volumetric limit holds, and every request finishes."""
    cfg = config(backend=backend, step_budget_ms=budget, max_batch_tkv_limit=tkv_limit, max_num_seqs=6)
    s = make_scheduler(cfg)
    cost = StepCost(*COST)
    rows, steps = drive(s, arrivals(), 200)
    checked, decoded_at = 0, {}
    for t, (step, num_running) in enumerate(steps):
        assert num_running <= cfg.max_num_seqs
        assert step_fits([row.position for row in step.decode], tkv_limit)
        smallest = cost.of(min(cfg.chunk_buckets) if backend == "sendnn" else 8, len(step.decode))
        if step.decode and step.chunks and smallest <= budget:
            assert cost.of(step.chunk_size, len(step.decode)) <= budget
            checked += 1
        for row in step.decode:
            decoded_at.setdefault(row.request.request_id, []).append(t)
    assert checked >= 3 or budget < 10 + 64 + 2  # 40 ms: below the smallest chunk, prompts still progress
    if not tkv_limit:  # nothing pauses: a running stream decodes in every step until it finishes
        assert all(b - a == 1 for ts in decoded_at.values() for a, b in itertools.pairwise(ts))
    assert not s.has_work()
    assert rows[-1][1:] == ((), (), 0, ())


def test_the_policy_off_schedules_as_before():
    """Off (the default, 0) is the token-count scheduler: the same steps as a configuration without the
    setting, whatever the cost model says."""
    a, _ = drive(make_scheduler(config(step_budget_ms=0, step_cost_us=(1, 99_000, 1))), arrivals(), 120)
    base = RuntimeConfig(
        model_dir=Path("unused"),
        served_model_name="t",
        use_cb=True,
        max_num_seqs=6,
        max_model_len=512,
        max_num_batched_tokens=128,
        mixed_prefill_tokens=0,
        wave_start=False,
    )
    assert base.step_budget_ms == 0
    b, _ = drive(make_scheduler(base), arrivals(), 120)
    assert a == b


def test_wave_pieces_hold_back_every_last_token_unless_the_window_fits():
    assert wave_pieces([10, 20], 28) == [10, 20]  # 9 + 19 chunk tokens: all finish
    assert wave_pieces([10, 20], 27) == [9, 19]  # held back: 8 + 18 chunk tokens
    assert wave_pieces([10, 20], 5) == [6, 1]  # the first prompt's 5, then a place for the second's next
    assert wave_pieces([1, 40], 8) == [0, 9]  # a prompt with only its last token waits
    assert wave_pieces([1, 1, 1], 0) == [1, 1, 1]  # last tokens only: they all fit (places, no chunk)


def test_step_cost_and_chunk_limit():
    cost = StepCost(10_000, 1_000, 2_000)
    assert cost.of(64, 2) == 78
    assert cost.tokens_within(100, 2) == 86
    assert cost.tokens_within(10, 2) == 0  # the rows alone pass the budget
    assert chunk_limit(86, (64, 128), dynamic=False) == 64
    assert chunk_limit(30, (64, 128), dynamic=False) == 64  # the smallest bucket: a prompt progresses
    assert chunk_limit(86, (), dynamic=True) == 80
    assert chunk_limit(3, (), dynamic=True) == 8


def test_the_settings_reach_the_scheduler(tiny_model):
    """SENDNN_INFERENCE_CB_STEP_BUDGET_MS and SENDNN_INFERENCE_CB_STEP_COST_US: off and run 20's cost by
    default; set, the scheduler plans with them."""
    env = {"SENDNN_INFERENCE_USE_CB": "1"}
    cfg = load_config(tiny_model, environ=env)
    assert type(make_scheduler(cfg)) is ContinuousScheduler  # off: the token-count scheduler itself
    assert cfg.step_budget_ms == 0 and cfg.step_cost_us == (34_000, 900, 2_600)
    env |= {
        "SENDNN_INFERENCE_CB_STEP_BUDGET_MS": "120",
        "SENDNN_INFERENCE_CB_STEP_COST_US": "20000, 500,1000",
    }
    s = make_scheduler(load_config(tiny_model, environ=env))
    assert (
        isinstance(s, WaveScheduler)
        and s.step_budget_ms == 120
        and s.step_cost == StepCost(20_000, 500, 1_000)
    )
