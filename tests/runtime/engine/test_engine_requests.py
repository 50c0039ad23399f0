"""The engine's request table and per-request failures, on the real tiny model (eager)."""

import pytest
from spyre_runtime.config import load_config
from spyre_runtime.engine.client import describe_in_flight
from spyre_runtime.engine.llm_engine import LLMEngine
from spyre_runtime.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model):
    env = {
        "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
        "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64",
        "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "32",
        "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "2",
    }
    eng = LLMEngine(load_config(tiny_model, environ=env))
    yield eng
    eng.close()


def run_to_end(engine):
    while engine.has_work():
        engine.step()


def test_aborted_requests_leave_the_request_table(engine):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    running = engine.add_request([5, 6, 7], params)
    engine.step()  # prefill: running
    waiting = engine.add_request([8, 9], params)  # static batching: waits for the batch
    for req in (running, waiting):
        out = engine.abort(req.request_id)
        assert out.finished and out.finish_reason == "abort"
    assert engine.requests == {}
    run_to_end(engine)  # the batch's last row is gone: it ends within a step
    assert not engine.has_work() and running.num_output_tokens < 20


def test_a_request_that_cannot_run_is_refused_before_it_is_queued(engine):
    with pytest.raises(ValueError, match="fits no compiled shape"):
        engine.add_request([1] * 100, SamplingParams(max_tokens=4))
    assert engine.requests == {} and not engine.has_work()


def test_prompt_logprobs_match_the_served_logprob_of_the_same_token(engine):
    prompt = [40, 41, 42, 43]
    scored = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    run_to_end(engine)
    forced = SamplingParams(max_tokens=1, temperature=0, logprobs=0, logit_bias=((43, 100.0),))
    served = engine.add_request(prompt[:-1], forced)
    run_to_end(engine)
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == 4
    assert served.output_token_ids == [43]
    assert scored.prompt_logprobs[-1].logprob == pytest.approx(served.logprobs[0].logprob, abs=1e-4)
    assert len(scored.prompt_logprobs[1].top) == 2


def test_a_drain_names_where_each_in_flight_request_is(engine):
    """The log line of a drain (engine/client.describe_in_flight): each request's age, and whether it waits,
    runs (with its tokens so far), has finished (its batch still runs), or is not in the engine at all; the
    oldest first."""
    long = engine.add_request([1, 2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    short = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    for _ in range(3):  # the prefill's token and two more: the short one is done, its batch runs on
        engine.step()
    waiting = engine.add_request([8, 9], SamplingParams(max_tokens=4))  # static batching: waits
    submitted = {"lost": 90.0, long.request_id: 50.0, short.request_id: 60.0, waiting.request_id: 99.5}
    report = describe_in_flight(submitted, engine.requests, now=100.0)
    assert report == (
        f"{long.request_id} (50.0 s, running, 3 tokens); {short.request_id} (40.0 s, finished, 3 tokens); "
        f"lost (10.0 s, not in the engine); {waiting.request_id} (0.5 s, waiting, 0 tokens)"
    )
    assert describe_in_flight(submitted, engine.requests, 100.0, limit=1) == f"{report.split(';')[0]}; 3 more"
    run_to_end(engine)
    assert describe_in_flight({}, engine.requests, 100.0) == "" and engine.requests == {}
