"""Beam search (use_beam_search, n beams, length_penalty, early_stopping):
- the algorithm (sampling.beam_search), driven by HF transformers' own logprobs, equals HF's `generate`
  beams on the tiny model in every stopping mode;
- the engine runs each step's beams as one-token requests on the continuous-batching scheduler, and they
  share the prompt's KV blocks through the prefix cache (the same block ids, one reference per beam);
- the HTTP API on a continuous-batching server equals HF's beams and refuses what beam search cannot do.
SmolLM2 against HF on 8 prompts is test_beam_search_smollm2.py."""

import pytest
import torch
from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.llm_engine import LLMEngine
from spyre_runtime.sampling.beam_search import BeamSearch
from spyre_runtime.sampling.params import SamplingParams
from transformers import AutoModelForCausalLM

from tests.httpclient import HTTP
from tests.runtime.serverproc import ServerProcess

MODES = [(2, 1.0, False), (3, 0.5, True), (4, 1.5, "never"), (3, 0.0, False), (2, -1.0, "never")]


def hf_beams(model, prompt: list[int], width: int, max_tokens: int, length_penalty: float, early_stopping):
    """HF's returned beams (tokens, as far as they go before padding) and their scores."""
    out = model.generate(
        torch.tensor([prompt]),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=max_tokens,
        do_sample=False,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        return_dict_in_generate=True,
        output_scores=True,
    )
    return out.sequences[:, len(prompt) :].tolist(), out.sequences_scores.tolist()


def assert_same_beams(ours, hf, pad: int) -> None:
    rows, scores = hf
    assert len(ours) == len(rows)
    for hyp, row, score in zip(ours, rows, scores, strict=True):
        assert row[: len(hyp.tokens)] == list(hyp.tokens), (hyp, row)
        assert all(t == pad for t in row[len(hyp.tokens) :]), (hyp, row)
        assert hyp.score == pytest.approx(score, abs=1e-3)


@pytest.fixture(scope="module")
def hf_tiny(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def drive(search: BeamSearch, next_logprobs) -> None:
    """Runs `search` to its end; next_logprobs(prefixes) -> [B, V] logprobs."""
    while not search.done:
        lps = next_logprobs([list(b.tokens) for b in search.running])
        values, ids = torch.topk(lps, search.num_candidates, dim=-1)
        search.advance(
            [list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(ids, values, strict=True)]
        )


@pytest.mark.parametrize(("width", "length_penalty", "early_stopping"), MODES)
def test_the_algorithm_on_hfs_logprobs_equals_hfs_beams(hf_tiny, width, length_penalty, early_stopping):
    for prompt in ([5, 9, 33, 71, 2, 40], [100, 7], list(range(10, 40))):
        search = BeamSearch(width, 10, {2}, length_penalty, early_stopping)

        def next_logprobs(prefixes, prompt=prompt):
            with torch.inference_mode():
                return torch.cat(
                    [
                        torch.log_softmax(hf_tiny(torch.tensor([prompt + p])).logits[:, -1].float(), -1)
                        for p in prefixes
                    ]
                )

        drive(search, next_logprobs)
        hf = hf_beams(hf_tiny, prompt, width, 10, length_penalty, early_stopping)
        assert_same_beams(search.results(), hf, pad=0)


def test_eos_ends_a_hypothesis_and_max_tokens_ends_the_search():
    # two tokens: 1 (likely) and 2 (EOS); every beam's next-token table is the same
    table = [(1, -0.1), (2, -2.5)]
    search = BeamSearch(2, 3, {2}, length_penalty=1.0, early_stopping=False)
    while not search.done:
        search.advance([table] * len(search.running))
    best, second = search.results()
    assert best.tokens == (1, 1, 1) and not best.is_eos and best.score == pytest.approx(-0.1)
    assert second.tokens[-1] == 2 and second.is_eos
    assert search.num_generated == 3


def test_beams_share_the_prompts_kv_blocks_through_the_prefix_cache(tiny_model):
    config = RuntimeConfig(
        model_dir=tiny_model,
        served_model_name="t",
        backend="eager",
        use_cb=True,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )
    engine = LLMEngine(config)
    blocks = engine.scheduler.blocks
    seen = []
    allocate = blocks.allocate

    def spy(seq_id, token_ids, salt=0):
        allocation = allocate(seq_id, token_ids, salt)
        seen.append((seq_id, allocation, [blocks.blocks[b].ref_count for b in allocation.block_table]))
        return allocation

    blocks.allocate = spy
    prompt = [(7 * i) % 400 + 3 for i in range(150)]  # two full blocks, then a partial one
    search = BeamSearch(3, 6, engine.outputs.eos_ids)
    steps = []
    while not search.done:
        params = SamplingParams(max_tokens=1, temperature=0, logprobs=search.num_candidates)
        start = len(seen)
        reqs = [engine.add_request(prompt + list(b.tokens), params) for b in search.running]
        while engine.has_work():
            engine.step()
        steps.append(seen[start:])
        search.advance([list(r.logprobs[0].top) for r in reqs])
    assert len(steps) == 6 and len(steps[0]) == 1  # one beam for the first token, then three
    for step in steps[1:]:
        assert len(step) == 3
        tables = [a.block_table for _, a, _ in step]
        assert all(a.num_cached_tokens == 128 for _, a, _ in step)  # both full prompt blocks were hits
        assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # the very same blocks, not copies
        assert step[-1][2][:2] == [3, 3]  # one reference per beam
        assert len({t[2] for t in tables}) == 3  # each beam's own last block
    # HF's beams on the same model, for the same prompt
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    assert_same_beams(search.results(), hf_beams(hf, prompt, 3, 6, 1.0, False), pad=0)


ENV = {"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_USE_CB": "1"}
ARGS = ("--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = ServerProcess(tiny_model, ENV, tmp_path_factory.mktemp("beam") / "server.log", extra_args=ARGS)
    with srv.serving():
        yield srv


def test_completions_return_hfs_beams_best_first(server, hf_tiny, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    client = server.client()
    prompts = [[5, 9, 33, 71, 40], [100, 7, 8]]
    res = client.completions.create(
        model="tiny",
        prompt=prompts,
        max_tokens=8,
        n=3,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    )
    assert len(res.choices) == 6 and [c.index for c in res.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        rows, _ = hf_beams(hf_tiny, prompt, 3, 8, 0.5, False)
        for choice, row in zip(res.choices[3 * i : 3 * i + 3], rows, strict=True):
            tokens = row[: row.index(2)] if 2 in row else row
            assert choice.text == tok.decode(tokens, skip_special_tokens=True)
            assert choice.finish_reason == ("stop" if 2 in row else "length")
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, n=2, extra_body={"use_beam_search": True}
    )
    ids = HTTP.post(server.base + "/tokenize", json={"messages": messages}).json()["tokens"]
    rows, _ = hf_beams(hf_tiny, ids, 2, 5, 1.0, False)
    texts = [tok.decode(row[: row.index(2)] if 2 in row else row, skip_special_tokens=True) for row in rows]
    assert [c.message.content for c in chat.choices] == texts and chat.usage.prompt_tokens == len(ids)


BAD = [
    ({"use_beam_search": True, "stream": True}, "stream"),
    ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
    ({"use_beam_search": True, "n": 11}, "n"),
    ({"use_beam_search": True, "guided_choice": ["a"]}, "guided_choice"),
    ({"use_beam_search": True, "stop": ["x"]}, "stop"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"early_stopping": True}, "early_stopping"),
    ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
]


@pytest.mark.parametrize(("change", "param"), BAD)
def test_what_beam_search_cannot_do_is_a_400(server, change, param):
    res = HTTP.post(
        server.base + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4, **change}
    )
    assert res.status_code == 400 and res.json()["error"]["param"] == param, res.text
    assert HTTP.get(server.base + "/health").status_code == 200
