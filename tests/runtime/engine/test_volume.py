"""Spyre's volumetric limit (VLLM_DT_MAX_BATCH_TKV_LIMIT) and sendnn-inference 2.x's request pausing: the pure
rules, golden scheduler tables with no model, the known configuration's limit reaching the scheduler, and the
server's 400 and `sendnn:*` metrics."""

from pathlib import Path

import pytest
from spyre_contract import read_environment
from spyre_contract.registry import Verdict
from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.sched.continuous import ContinuousScheduler
from spyre_runtime.engine.sched.volume import (
    Row,
    admits,
    decode_order,
    fits_alone,
    next_decode_tkv,
    step_fits,
    with_known_tkv_limit,
)
from spyre_runtime.request import Request
from spyre_runtime.sampling.params import SamplingParams

# ---- the pure rules -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("contexts", "tkv"),
    [
        ([], 0),
        ([10], 11),  # one row: its context and the new token
        ([63], 64),  # the new token fills the block
        ([64], 65),  # ... or starts a second one
        ([100, 10], 101),  # the short row is left-padded by one block: 64 + 11 = 75 < 101
        ([100, 60], 125),  # 64 + 61: the short row's padded length is the step's
        ([127, 20], 128),
        ([128, 20], 149),  # 3 blocks after the new token: the short row padded by 2 blocks = 128 + 21
    ],
)
def test_the_step_context_is_the_widest_padded_row(contexts, tkv):
    assert next_decode_tkv(contexts) == tkv


def test_a_step_fits_when_rows_times_context_stay_under_the_limit():
    assert step_fits([100, 10], 202) and not step_fits([100, 10], 201)  # 2 x 101
    assert step_fits([10] * 8, 88) and not step_fits([10] * 8, 87)  # 8 x 11
    assert step_fits([10_000] * 64, 0)  # 0: no limit


def test_a_request_that_could_never_run_alone_is_refused():
    assert fits_alone(100, 28, 128) and not fits_alone(100, 29, 128)  # 129 tokens take 3 blocks: 192
    assert fits_alone(10**6, 10**6, 0)


def test_the_forward_check_admits_while_every_future_step_fits():
    # alone: 60 + 40 - 1 tokens round up to 128, plus one block of slack = 192
    assert admits(Row(60, 40), [], 192) and not admits(Row(60, 40), [], 191)
    # two rows of 60 + 40: 2 x 192 at their common end
    assert admits(Row(60, 40), [Row(60, 40)], 384) and not admits(Row(60, 40), [Row(60, 40)], 383)
    # a long row that outlives the new one: the pair while both run (2 x the new row's 192), then the long
    # row alone (1 x 320: 60 + 200 - 1 rounds to 256, + 64)
    assert admits(Row(60, 40), [Row(60, 200)], 384)
    assert not admits(Row(60, 40), [Row(60, 200)], 319)
    assert admits(Row(1, 1), [Row(10_000, 10_000)] * 4, 0)


def test_paused_requests_go_first_then_the_shortest_output_unless_long_outputs_have_priority():
    candidates = [("a", 0, 30), ("b", 0, 5), ("c", 2, 50), ("d", 0, 5)]
    assert decode_order(candidates, long_output_first=False) == ["c", "b", "d", "a"]
    assert decode_order(candidates, long_output_first=True) == ["c", "a", "b", "d"]


# ---- golden scheduler tables ----------------------------------------------------------------------


def config(**kw) -> RuntimeConfig:
    base = {
        "max_model_len": 256,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 128,
        "use_cb": True,
        "mixed_prefill_tokens": 0,
        "wave_start": False,  # the scheduler's own start of a decode (test_wave_start.py: a wave's)
    }
    return RuntimeConfig(model_dir=Path("unused"), served_model_name="t", **(base | kw))


def req(rid: str, prompt: int, max_tokens: int) -> Request:
    return Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens, temperature=0))


def drive(sched: ContinuousScheduler, arrivals: dict[int, list[Request]], num_steps: int) -> list[tuple]:
    """Each row: (step, request ids decoded, request ids prefilled, paused ids, rows x context of the decode,
    finished). A fake engine appends token 7 and finishes a request at its max_tokens."""
    rows = []
    for t in range(num_steps):
        for r in arrivals.get(t, []):
            sched.add(r)
        step = sched.schedule()
        if step is None:
            rows.append((t, (), (), (), 0, ()))
            continue
        volume = len(step.decode) * next_decode_tkv([d.position for d in step.decode])
        for r in step.requests:
            r.output_token_ids.append(7)
            if r.num_output_tokens >= r.sampling.max_tokens:
                r.finish("length")
        done = sched.update(step)
        rows.append(
            (
                t,
                tuple(d.request.request_id for d in step.decode),
                tuple(c.request.request_id for c in step.chunks),
                tuple(r.request_id for r in sched.paused),
                volume,
                tuple(r.request_id for r in done),
            )
        )
    return rows


def test_pausing_rotates_rows_that_do_not_fit_one_step_together():
    # limit 200: a (100-token prompt) decodes at a context near 101; b (10 tokens) beside it makes the step
    # 2 x 101 = 202, over the limit, so one of them sits each step out: the shortest output first, then the
    # longest paused (the rotation sendnn-inference's scheduler does)
    s = ContinuousScheduler(config(max_batch_tkv_limit=200))
    a, b = req("a", 100, 4), req("b", 10, 3)
    rows = drive(s, {0: [a], 2: [b]}, 9)
    assert rows == [
        (0, (), ("a",), (), 0, ()),  # a's prompt, its first token
        (1, ("a",), (), (), 101, ()),
        (2, ("a",), ("b",), (), 102, ()),  # b's prompt beside a's decode (b is not decoding yet)
        (3, ("b",), (), ("a",), 11, ()),  # b has the shorter output: a waits (2 x 103 > 200)
        (4, ("a",), (), ("b",), 103, ("a",)),  # a waited longest: b waits; a's fourth token ends it
        (5, ("b",), (), (), 12, ("b",)),  # b resumes alone and ends
        (6, (), (), (), 0, ()),
        (7, (), (), (), 0, ()),
        (8, (), (), (), 0, ()),
    ]
    assert (s.num_pause_events, s.num_resume_events) == (2, 2)
    assert all(volume <= 200 for *_, volume, _ in rows)


def test_nothing_new_starts_while_a_request_is_paused():
    s = ContinuousScheduler(config(max_batch_tkv_limit=200))
    a, b, c = req("a", 100, 4), req("b", 10, 3), req("c", 10, 2)
    rows = drive(s, {0: [a], 2: [b], 3: [c]}, 7)
    # c arrives at step 3 while a is paused, and starts at step 5, when nothing is
    assert [(r[2], r[3]) for r in rows[3:6]] == [((), ("a",)), ((), ("b",)), (("c",), ())]
    assert rows[6][1:] == (("c",), (), (), 11, ("c",))


def test_without_pausing_a_request_waits_until_the_batch_it_would_join_fits_at_its_end():
    s = ContinuousScheduler(config(max_batch_tkv_limit=250, pausing_enabled=False))
    a, b = req("a", 100, 4), req("b", 10, 3)
    rows = drive(s, {0: [a], 1: [b]}, 8)
    # a alone: 100 + 4 - 1 rounds to 128, + 64 = 192; b beside it: 2 x 192 = 384 > 250: b waits for a
    assert rows == [
        (0, (), ("a",), (), 0, ()),
        (1, ("a",), (), (), 101, ()),
        (2, ("a",), (), (), 102, ()),
        (3, ("a",), (), (), 103, ("a",)),
        (4, (), ("b",), (), 0, ()),
        (5, ("b",), (), (), 11, ()),
        (6, ("b",), (), (), 12, ("b",)),
        (7, (), (), (), 0, ()),
    ]
    assert s.num_pause_events == 0


def test_no_limit_changes_nothing():
    a, b = req("a", 100, 4), req("b", 10, 3)
    rows = drive(ContinuousScheduler(config()), {0: [a], 2: [b]}, 6)
    assert rows[3] == (3, ("a", "b"), (), (), 2 * 103, ("a",))  # both rows, over what 200 would allow


def test_a_request_past_the_limit_alone_is_refused_naming_it():
    s = ContinuousScheduler(config(max_batch_tkv_limit=128))
    assert s.can_admit(100, 28) and not s.can_admit(100, 29)
    assert "VLLM_DT_MAX_BATCH_TKV_LIMIT=128" in s.describe_limits()


# ---- where the limit comes from -------------------------------------------------------------------


def test_the_limit_is_read_from_the_environment():
    assert read_environment({}).max_batch_tkv_limit == 0
    s = read_environment({"VLLM_DT_MAX_BATCH_TKV_LIMIT": "131072", "SENDNN_INFERENCE_PAUSING_ENABLED": "0"})
    assert (s.max_batch_tkv_limit, s.pausing_enabled, s.long_output_priority) == (131072, False, False)
    with pytest.raises(ValueError, match="VLLM_DT_MAX_BATCH_TKV_LIMIT='lots' is not an integer"):
        read_environment({"VLLM_DT_MAX_BATCH_TKV_LIMIT": "lots"})


def test_the_known_configuration_s_limit_reaches_the_scheduler():
    from spyre_contract.registry import current_platform, load_registry

    var, platform = "VLLM_DT_MAX_BATCH_TKV_LIMIT", current_platform()
    known = [(m, c) for m in load_registry().models for c in m.configs(platform) if var in dict(c.env)]
    model, cfg4 = known[0]
    verdict = Verdict(True, "known", model, cfg4)
    cfg = with_known_tkv_limit(config(), verdict)
    assert cfg.max_batch_tkv_limit == int(dict(cfg4.env)[var]) == 131072
    assert ContinuousScheduler(cfg).tkv_limit == cfg.max_batch_tkv_limit
    # the pod's own setting wins
    assert with_known_tkv_limit(config(max_batch_tkv_limit=4096), verdict).max_batch_tkv_limit == 4096
    assert with_known_tkv_limit(config(), Verdict(False, "unknown")).max_batch_tkv_limit == 0


# ---- through the server ---------------------------------------------------------------------------

VOLUME_ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
    "SENDNN_INFERENCE_USE_CB": "1",
    "VLLM_DT_MAX_BATCH_TKV_LIMIT": "192",
}
VOLUME_ARGS = ("--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "128")


@pytest.fixture(scope="module")
def volume_server(tiny_model, tmp_path_factory):
    from tests.runtime.serverproc import ServerProcess

    log = tmp_path_factory.mktemp("volume") / "server.log"
    srv = ServerProcess(tiny_model, VOLUME_ENV, log, extra_args=VOLUME_ARGS)
    with srv.serving():
        yield srv


def test_a_request_over_the_limit_alone_is_a_400_naming_it(volume_server):
    import openai

    client = volume_server.client(timeout=120)
    with pytest.raises(openai.BadRequestError, match=r"VLLM_DT_MAX_BATCH_TKV_LIMIT=192") as err:
        client.completions.create(model="tiny", prompt="word " * 10, max_tokens=190)  # 201 -> 256 > 192
    assert err.value.body["param"] == "max_tokens"
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens >= 1


def test_paused_streams_give_what_they_give_alone_and_the_sendnn_metrics_count_the_pauses(volume_server):
    import threading

    from tests.runtime.entrypoints.test_completions import metric

    client = volume_server.client(timeout=300)
    # two prompts near 100 tokens: together a step is 2 x ~110 > 192, so they take turns (each alone fits)
    prompts = ["word " * 33, "more " * 33]

    def complete(prompt):
        kw = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
        return client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text

    alone = [complete(p) for p in prompts]
    results: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, complete(prompts[i]))) for i in (0, 1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [results.get(0), results.get(1)] == alone
    labels = '{engine="0",model_name="tiny"}'
    pauses = metric(volume_server, "sendnn:pause_events_total", labels)
    assert pauses >= 1
    assert metric(volume_server, "sendnn:resume_events_total", labels) == pauses  # every pause ended
    assert metric(volume_server, "sendnn:paused", labels) == 0
    assert metric(volume_server, "sendnn:decode_batch", labels) == 1  # the last step: one row left
