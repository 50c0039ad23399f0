"""The newer decoder families (issue 27) on tiny seeded models: greedy tokens of static and continuous
batching, on eager and inductor, equal HF transformers' on the same weights (Qwen3, Mistral, Granite 4
dense, the sliding-window Granite with prompts longer than its window, an FP8 checkpoint against its
dequantized weights); a sliding window frees the KV blocks every later token cannot see; an architecture
we do not serve stops `spyre-runtime serve` at start-up with one line."""

import json
import os
import random
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from spyre_runtime.config import RuntimeConfig, Shape
from spyre_runtime.engine.llm_engine import LLMEngine
from spyre_runtime.executor.kv_cache import BLOCK_SIZE, blocks_for
from spyre_runtime.sampling.params import SamplingParams
from spyre_runtime.testing.models import write_tiny_model
from spyre_runtime.testing.tiny_models import TINY_WINDOW
from transformers import AutoConfig, AutoModelForCausalLM

MAX_TOKENS = 12
# (arch, seed): granite_swa has a full-attention first layer and sliding ones after; -fp8 is a granite
FAMILIES = [("qwen3", 2), ("granite4", 3), ("granite_swa", 4), ("granite-fp8", 5), ("mistral", 7)]
MODES = [("static", "eager"), ("continuous", "eager"), ("static", "inductor"), ("continuous", "inductor")]


def prompts(vocab: int) -> list[list[int]]:
    """Short, one chunk long, and longer than the sliding window and than one KV block (150 tokens)."""
    rng = random.Random(11)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (9, 70, 150)]


def reference_model(model_dir):
    """HF transformers' model of the folder; for an FP8 checkpoint, of its dequantized weights (each FP8
    weight times its per-channel scale), written here independently of the runtime's loader."""
    config = AutoConfig.from_pretrained(model_dir)
    if getattr(config, "quantization_config", None) is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = load_file(str(model_dir / "model.safetensors"))
    weights = {
        name: t.float() * state[f"{name}_scale"] if f"{name}_scale" in state else t.float()
        for name, t in state.items()
        if not name.endswith("_scale")
    }
    model.load_state_dict(weights, strict=True)
    return model


@torch.no_grad()
def hf_greedy(model, prompt_ids) -> list[list[int]]:
    """Argmax of HF's forward, token by token (generate's min_new_tokens would hide the EOS token, which the
    engine's ignore_eos still lets win)."""
    out = []
    for ids in prompt_ids:
        tokens = list(ids)
        for _ in range(MAX_TOKENS):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        out.append(tokens[len(ids) :])
    return out


def engine_config(model_dir, mode: str, backend: str) -> RuntimeConfig:
    base = RuntimeConfig(model_dir=model_dir, served_model_name="t", backend=backend, max_model_len=256)
    if mode == "static":
        return replace(base, shapes=(Shape(192, 16, 4),))
    cb = replace(base, use_cb=True, max_num_seqs=4, max_num_batched_tokens=64)
    # inductor: one decode bucket and one KV bucket, so warm-up compiles few graphs
    return replace(cb, decode_batch_buckets=(4,), kv_len_buckets=(256,)) if backend == "inductor" else cb


def run_engine(engine, prompt_ids, max_tokens=MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(ids, params) for ids in prompt_ids]
    while engine.has_work():
        engine.step()
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """arch -> (model folder, prompts, HF's greedy tokens), made once per module."""
    made = {}

    def get(arch: str, seed: int):
        if arch not in made:
            model_dir = write_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, seed=seed)
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            ids = prompts(vocab)
            made[arch] = (model_dir, ids, hf_greedy(reference_model(model_dir), ids))
        return made[arch]

    return get


@pytest.mark.parametrize(("mode", "backend"), MODES, ids=[f"{m}-{b}" for m, b in MODES])
@pytest.mark.parametrize(("arch", "seed"), FAMILIES, ids=[a for a, _ in FAMILIES])
def test_greedy_matches_hf(family, arch, seed, mode, backend):
    model_dir, ids, expected = family(arch, seed)
    assert max(len(i) for i in ids) > TINY_WINDOW + BLOCK_SIZE  # the window really drops tokens
    engine = LLMEngine(engine_config(model_dir, mode, backend))
    engine.executor.warmup()
    assert run_engine(engine, ids) == expected


def test_fp8_checkpoint_is_loaded_with_its_scales(family):
    model_dir, _, _ = family("granite-fp8", 5)
    state = load_file(str(model_dir / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    assert state[name].dtype == torch.float8_e4m3fn and state[f"{name}_scale"].shape == (64, 1)
    engine = LLMEngine(engine_config(model_dir, "static", "eager"))
    dense = engine.executor.model.base_model.layers[0].attn.dense.weight
    assert torch.equal(dense, state[name].float() * state[f"{name}_scale"])
    assert not torch.equal(dense, state[name].float())  # the scales were applied


def test_sliding_window_frees_blocks_behind_every_window(tmp_path):
    """Every layer sliding: while a 150-token prompt decodes, the blocks its window has left go back to the
    pool, and the tokens still equal HF's."""
    model_dir = write_tiny_model(tmp_path / "swa", arch="granite_swa_all", seed=6)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ids = prompts(vocab)[2:]
    expected = hf_greedy(reference_model(model_dir), ids)
    engine = LLMEngine(engine_config(model_dir, "continuous", "eager"))
    assert engine.scheduler.blocks.window == TINY_WINDOW
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    req = engine.add_request(ids[0], params)
    held = []
    while engine.has_work():
        engine.step()
        if not req.is_finished:
            held.append(engine.scheduler.blocks.num_used_blocks)
    assert req.output_token_ids == expected[0]
    assert engine.scheduler.blocks.num_used_blocks == 0
    # 150 + 12 tokens would hold 3 blocks; past position 127 + 64 only the last two are live
    assert max(held) == blocks_for(len(ids[0]) + 1) and min(held) == 2
    table = engine.scheduler.blocks
    assert table.num_free_blocks == table.num_pool_blocks


def serve(model_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager"}
    return subprocess.run(
        [sys.executable, "-m", "spyre_runtime.cli", "serve", str(model_dir), "--port", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture GPT2LMHeadModel is not supported; supported:"),
        ({"architectures": ["GraniteMoeHybridForCausalLM"], "num_local_experts": 8}, "num_local_experts=8"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method='gptq'"),
    ],
    ids=["unknown", "granite4-moe", "gptq"],
)
def test_unsupported_model_stops_serve_at_start_up(tiny_model, tmp_path, change, named):
    """Exit code 2 and one line on stderr, before anything loads (the port is never bound)."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for f in tiny_model.iterdir():
        (model_dir / f.name).symlink_to(f)
    (model_dir / "config.json").unlink()
    config = json.loads((tiny_model / "config.json").read_text()) | change
    (model_dir / "config.json").write_text(json.dumps(config))
    result = serve(model_dir)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert named in lines[0]
    if "GPT2" in named:
        assert "Qwen3ForCausalLM" in lines[0] and "GraniteSWAForCausalLM" in lines[0]


def test_prefix_hit_on_blocks_the_window_freed(tmp_path):
    """Prefix caching stays on with a sliding window: a block one sequence's window left behind goes back to
    the pool still cached, and a later prompt with the same start hits it; its tokens still equal HF's."""
    model_dir = write_tiny_model(tmp_path / "swa", arch="granite_swa_all", seed=6)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    first = prompts(vocab)[2]
    second = first[:128] + prompts(vocab)[1][:30]
    expected = hf_greedy(reference_model(model_dir), [first, second])
    engine = LLMEngine(engine_config(model_dir, "continuous", "eager"))
    assert run_engine(engine, [first]) == expected[:1]
    assert run_engine(engine, [second]) == expected[1:]
    assert engine.scheduler.num_cached_tokens == 128  # both of the first prompt's full blocks


def test_window_release_keeps_shared_blocks_referenced():
    """Two sequences share a cached prompt block; one's window leaves it: the other still holds it."""
    from spyre_runtime.engine.block_manager import BlockManager

    blocks = BlockManager(8, window=64)
    prompt = list(range(3, 3 + 130))
    blocks.allocate("a", prompt)
    blocks.commit("a", len(prompt))
    table_b = blocks.allocate("b", prompt).block_table
    shared = table_b[0]
    assert blocks.blocks[shared].ref_count == 2
    assert blocks.free_outside_window("a", 126) == 0  # position 126 still sees slot 63
    assert blocks.free_outside_window("a", 127) == 1
    assert blocks.block_table("a")[0] == 0 and blocks.blocks[shared].ref_count == 1
    assert blocks.free_outside_window("a", 200) == 1  # the second block; scratch places are skipped
    blocks.free("a")
    blocks.free("b")
    assert blocks.num_free_blocks == blocks.num_pool_blocks


def test_static_twins_of_the_paged_ops_honour_window_and_sinks():
    """sendnn runs the static-shape twins of the paged ops: the same results with a window and sinks."""
    from spyre_runtime.executor import kv_cache

    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(8, BLOCK_SIZE, 2, 16, generator=gen) for _ in range(2)]
    sinks = torch.randn(4, generator=gen)
    table = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 7]])
    seq_lens = torch.tensor([150, 230])
    query = torch.randn(2, 4, 16, generator=gen)
    for window in (0, 64):
        paged = kv_cache.paged_decode(query, *caches, table, seq_lens, 0.25, sinks, window)
        static = kv_cache.static_paged_decode(query, *caches, table, seq_lens, 0.25, sinks, window)
        torch.testing.assert_close(paged, static)
    tokens = torch.randn(20, 4, 16, generator=gen)
    token_piece = torch.tensor([0] * 10 + [1] * 10)
    token_pos = torch.cat([torch.arange(140, 150), torch.arange(200, 210)])
    lens = torch.tensor([150, 210])
    for window in (0, 64):
        paged = kv_cache.paged_prefill(
            tokens, *caches, table, lens, token_piece, token_pos, 0.25, sinks, window
        )
        static = kv_cache.static_paged_prefill(
            tokens, *caches, table, lens, token_piece, token_pos, 0.25, sinks, window
        )
        torch.testing.assert_close(paged, static)


SERVER_ENV = {
    "static": {
        "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "192",
        "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "16",
        "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "2",
    },
    "continuous": {"SENDNN_INFERENCE_USE_CB": "1"},
}


@pytest.mark.parametrize(
    ("arch", "seed", "mode"), [("granite_swa", 4, "continuous"), ("granite-fp8", 5, "static")]
)
def test_served_over_http_with_the_openai_client(family, tmp_path, arch, seed, mode):
    """`spyre-runtime serve` of the family answers the official openai client's completions with HF's
    greedy tokens (token-id prompts, tokens returned as ids)."""
    from tests.runtime.serverproc import ServerProcess

    model_dir, ids, expected = family(arch, seed)
    env = {"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", **SERVER_ENV[mode]}
    srv = ServerProcess(model_dir, env, tmp_path / "server.log", extra_args=("--max-model-len", "256"))
    with srv.serving():
        client = srv.client()
        for prompt, tokens in zip(ids, expected, strict=True):
            res = client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=1,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            )
            got = [int(t.removeprefix("token_id:")) for t in res.choices[0].logprobs.tokens]
            assert got == tokens, srv.log()
