"""Waves kept whole through the real engine (the tiny model, eager): a wave of prompts arriving beside
running streams gets the same greedy tokens with the step-time policy on as off, and on, the wave's
prompts get their first token in the same step. So does a chunk longer than --max-model-len, which holds the
wave's prompts side by side (vLLM's CPU server budgets 2,048 tokens a step whatever the model length)."""

import pytest
from spyre_runtime.config import load_config
from spyre_runtime.engine.llm_engine import LLMEngine
from spyre_runtime.engine.sched.waves import WaveScheduler
from spyre_runtime.sampling.params import SamplingParams

RUNNING = [[3 + i for i in range(20)], [50 + i for i in range(24)]]
WAVE = [[(7 * i + 11 * j) % 200 + 1 for j in range(40 + 9 * i)] for i in range(3)]


def serve(tiny_model, budget_ms: int, max_model_len=256, chunk=128, wave_start=False):
    """Every request's tokens, the step each wave prompt got its first token in, and its second."""
    env = {
        "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
        "SENDNN_INFERENCE_USE_CB": "1",
        "SENDNN_INFERENCE_CB_STEP_BUDGET_MS": str(budget_ms),
        # 10 ms a step, 1 ms a chunk token, 2 ms a decode row: 64 prompt tokens beside 2 rows at 90 ms
        "SENDNN_INFERENCE_CB_STEP_COST_US": "10000,1000,2000",
        "SENDNN_INFERENCE_CB_WAVE_START": "1" if wave_start else "0",
    }
    engine = LLMEngine(
        load_config(
            tiny_model, environ=env, max_num_seqs=5, max_model_len=max_model_len, max_num_batched_tokens=chunk
        )
    )
    try:
        assert isinstance(engine.scheduler, WaveScheduler) == bool(budget_ms)
        engine.executor.warmup()  # as serving does: every chunk length and decode bucket, on scratch blocks
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        requests = [engine.add_request(p, params) for p in RUNNING]
        engine.step()  # the two prompts
        engine.step()  # their first decode
        wave = [engine.add_request(p, params) for p in WAVE]
        first, second, t = [None] * len(wave), [None] * len(wave), 0
        while engine.has_work():
            engine.step()
            t += 1
            for i, r in enumerate(wave):
                if first[i] is None and r.num_output_tokens:
                    first[i] = t
                if second[i] is None and r.num_output_tokens > 1:
                    second[i] = t
        return [r.output_token_ids for r in requests + wave], first, second
    finally:
        engine.close()


@pytest.fixture(scope="module")
def policy_off(tiny_model):
    return serve(tiny_model, 0)


@pytest.mark.parametrize("budget_ms", [90, 200])
def test_a_wave_gets_the_same_greedy_tokens_with_the_policy_on(tiny_model, policy_off, budget_ms):
    off, off_first, _ = policy_off
    on, on_first, _ = serve(tiny_model, budget_ms)
    assert on == off and all(len(tokens) == 12 for tokens in on)
    assert len(set(on_first)) == 1  # the wave starts decoding in one step
    assert len(set(off_first)) > 1  # the token-count scheduler split it


def test_a_chunk_longer_than_a_sequence_prefills_the_wave_in_one_step(tiny_model, policy_off):
    """--max-model-len 128 and a 256-token chunk: the wave's 147 prompt tokens (three prompts) fit one step,
    which the warm-up laid out as two pieces of 128 (one piece of 256 overran a sequence's blocks)."""
    off, off_first, _ = policy_off
    whole, whole_first, _ = serve(tiny_model, 0, max_model_len=128, chunk=256)
    assert whole == off and all(len(tokens) == 12 for tokens in whole)
    assert len(set(whole_first)) == 1 and len(set(off_first)) > 1


def test_a_wave_that_starts_together_gets_the_same_greedy_tokens(tiny_model, policy_off):
    """SENDNN_INFERENCE_CB_WAVE_START=1 with the token-count scheduler: the wave's first prompts get their
    first token as early as off (it takes two steps), then wait, so the wave decodes from one step on."""
    off, off_first, off_second = policy_off
    on, on_first, on_second = serve(tiny_model, 0, wave_start=True)
    assert on == off and all(len(tokens) == 12 for tokens in on)
    assert on_first == off_first and len(set(on_first)) > 1
    assert len(set(on_second)) == 1 and len(set(off_second)) > 1
    assert on_second[0] == max(on_first) + 1
