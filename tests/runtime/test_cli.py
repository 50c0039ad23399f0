"""The offline commands: tiny-model is deterministic, generate turns JSONL prompts into JSONL results,
thread count follows SENDNN_INFERENCE_NUM_CPUS."""

import hashlib
import json
import os
import subprocess
import sys

from spyre_runtime.config import load_config
from spyre_runtime.engine.llm import LLM
from spyre_runtime.executor.model_executor import configure_threads
from spyre_runtime.sampling.params import SamplingParams


def cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "spyre_runtime.cli", "--log-level", "WARNING", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_model_is_seeded(tmp_path):
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        assert cli("tiny-model", str(tmp_path / name), "--seed", seed).returncode == 0
    assert digest(tmp_path / "a") == digest(tmp_path / "b") != digest(tmp_path / "c")
    assert json.loads((tmp_path / "a/config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    bad = cli("tiny-model", str(tmp_path / "d"), "--arch", "gpt9")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_generate_jsonl(tiny_model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "The capital of France", "max_tokens": 5, "ignore_eos": True},
        {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
        {"prompt": "too long", "max_tokens": 500},
    ]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out.jsonl"
    env = {"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "2"}
    res = cli("generate", str(tiny_model), "--prompts", str(prompts), "--output", str(out), env=env)
    assert res.returncode == 0, res.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(r.get("token_ids", [])) for r in results] == [5, 3, 0]
    assert "fit no compiled shape" in results[2]["error"]
    # the importable engine gives the same greedy tokens
    llm = LLM(tiny_model, environ={"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager"})
    same = llm.generate(
        ["The capital of France"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    assert list(same[0].token_ids) == results[0]["token_ids"]


def test_bad_prompts_file_is_one_line(tiny_model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "no prompt key"}\n')
    res = cli(
        "generate",
        str(tiny_model),
        "--prompts",
        str(prompts),
        env={"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager"},
    )
    assert res.returncode == 2 and 'line 1: expected a JSON object with a "prompt"' in res.stderr


def test_threads_follow_num_cpus():
    import torch

    before = torch.get_num_threads()
    try:
        assert configure_threads(load_config("/m", environ={"SENDNN_INFERENCE_NUM_CPUS": "1"})) == 1
        assert torch.get_num_threads() == 1
        off = load_config(
            "/m", environ={"SENDNN_INFERENCE_UPDATE_THREAD_CONFIG": "0", "SENDNN_INFERENCE_NUM_CPUS": "1"}
        )
        torch.set_num_threads(2)
        assert configure_threads(off) == 2
    finally:
        torch.set_num_threads(before)
