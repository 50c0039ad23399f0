"""The known-configurations registry (spyre_contract.registry) and the pooling environment rules
(spyre_contract.tasks): table tests of the pure functions, and the runtime's start-up refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from spyre_contract import ContractError, EngineFlags, Shape
from spyre_contract.registry import (
    PLATFORMS,
    check_known_config,
    load_registry,
    parse_registry,
    registry_settings,
)
from spyre_contract.tasks import check_task, read_pooling_environment
from spyre_runtime.config import check_known_configuration, load_config
from spyre_runtime.testing.models import write_tiny_cross_encoder

SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_hidden_layers": 30}
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}
MINILM = {"architectures": ["BertModel"], "hidden_size": 384, "num_hidden_layers": 6}
TINY_CE = {"architectures": ["BertForSequenceClassification"], "hidden_size": 32, "num_hidden_layers": 2}


def decoder(cfg, tp=1, max_model_len=512, max_num_seqs=4, **kw):
    return check_known_config(
        cfg["architectures"][0], "generate", tp, max_model_len, max_num_seqs, model_config=cfg, **kw
    )


# ---- the built-in file covers the models the project tests with ----------------------------------


@pytest.mark.parametrize("platform", PLATFORMS)
def test_builtin_knows_every_test_model_on_every_platform(platform):
    assert decoder(SMOLLM2, 1, 2048, 8, platform=platform).is_known
    assert decoder(SMOLLM2, 3, 8192, 8, platform=platform).is_known
    assert decoder(TINY_LLAMA, 2, 1024, 16, platform=platform).is_known
    granite = {**TINY_LLAMA, "architectures": ["GraniteForCausalLM"]}
    assert decoder(granite, 1, 84, 1, platform=platform).is_known
    minilm = check_known_config(
        "BertModel",
        "embed",
        shapes=[Shape(64, 0, 8), Shape(256, 0, 1)],
        model_config=MINILM,
        platform=platform,
    )
    assert minilm.is_known, minilm.message
    for task in ("score", "rerank"):
        ce = check_known_config(
            TINY_CE["architectures"][0], task, shapes=[(64, 4)], model_config=TINY_CE, platform=platform
        )
        assert ce.is_known, ce.message


def test_known_verdict_names_the_entry():
    v = decoder(SMOLLM2, 1, 1024, 4, model_name="smollm2")
    assert v.is_known and v.model.name == "SmolLM2-135M-Instruct"
    assert v.config.max_model_len == 2048 and v.env == {}


# ---- unknown configurations: one line, the model and the nearest known configuration -------------


def test_unknown_decoder_limits_name_the_nearest_configuration():
    v = decoder(SMOLLM2, 1, 4096, 4, model_name="smollm2", platform="x86_64")
    assert not v.is_known
    assert "\n" not in v.message
    assert v.message.startswith(
        "unknown configuration: smollm2 (LlamaForCausalLM) with tensor_parallel_size=1"
    )
    assert "max_model_len=4096" in v.message
    assert (
        "nearest known: SmolLM2-135M-Instruct (LlamaForCausalLM) with tensor_parallel_size=1, " in v.message
    )
    # 8192 x 2 is nearer to 4096 x 4 than 2048 x 8? both are one doubling away in each limit: either is fine,
    # but the nearest must be on the same tensor-parallel size
    assert v.config.tensor_parallel_size == 1


def test_tensor_parallel_size_must_match_exactly():
    v = decoder(SMOLLM2, 2, 512, 1)
    assert not v.is_known and "tensor_parallel_size=2" in v.message
    assert v.config.tensor_parallel_size in (1, 3)


def test_unknown_pooling_shape_names_the_nearest_listed_shape():
    v = check_known_config("BertModel", "embed", shapes=[(64, 4), (512, 1)], model_config=MINILM)
    assert not v.is_known
    assert "warmup_shapes=[[64, 4], [512, 1]]" in v.message
    assert v.message.endswith(
        "all-MiniLM-L6-v2 (BertModel) with tensor_parallel_size=1, warmup shape [256, 1] instead of [512, 1]"
    )


def test_unknown_model_names_a_known_model_of_the_same_architecture():
    other = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32}
    v = decoder(other, 1, 512, 4, model_name="llama-7b")
    assert not v.is_known and "model not in the registry" in v.message
    assert "llama-7b (LlamaForCausalLM)" in v.message and "nearest known:" in v.message
    assert v.model.architecture == "LlamaForCausalLM"
    xlmr = check_known_config("XLMRobertaModel", "embed", shapes=[(64, 1)])
    assert not xlmr.is_known and "nearest known: all-MiniLM-L6-v2" in xlmr.message


def test_platform_without_configurations_is_unknown():
    v = decoder(SMOLLM2, 1, 512, 1, platform="aarch64")
    assert not v.is_known and "no known configuration on aarch64" in v.message


def test_architecture_alone_matches_when_the_caller_has_no_config_json():
    # the operator may only know the architecture: any entry of that architecture counts
    assert check_known_config("LlamaForCausalLM", "generate", 1, 2048, 16).is_known
    assert not check_known_config("LlamaForCausalLM", "generate", 1, 16384, 1).is_known


def test_pooling_and_decoder_entries_never_match_each_other():
    v = check_known_config("BertModel", "generate", 1, 64, 1, model_config=MINILM)
    assert not v.is_known and "model not in the registry" in v.message
    assert v.model.task == "generate"  # the nearest is a decoder, never the embedding entry
    only_pooling = parse_registry(
        "models: [{name: e, architecture: BertModel, task: embed,"
        " platforms: {x86_64: [{warmup_shapes: [[64, 1]]}]}}]",
        "f.yaml",
    )
    v = check_known_config("BertModel", "generate", 1, 64, 1, registry=only_pooling)
    assert not v.is_known and v.message.endswith("(f.yaml); it lists no decoder model")


# ---- custom files ---------------------------------------------------------------------------------

CUSTOM = """
models:
  - name: my-llama
    architecture: LlamaForCausalLM
    platforms:
      s390x:
        - {tensor_parallel_size: 4, max_model_len: 32768, max_num_seqs: 32,
           env: {DT_OPT: "varsub=1", FLEX_X: 3}}
  - name: my-embedder
    architecture: XLMRobertaModel
    task: embed
    platforms:
      x86_64: [{warmup_shapes: [[128, 8], [512, 1]]}]
"""


def test_custom_file_replaces_the_builtin_and_carries_env_overrides(tmp_path):
    path = tmp_path / "known.yaml"
    path.write_text(CUSTOM)
    registry = load_registry(path)
    v = check_known_config("LlamaForCausalLM", "generate", 4, 8192, 16, platform="s390x", registry=registry)
    assert v.is_known and v.env == {"DT_OPT": "varsub=1", "FLEX_X": "3"}
    assert not check_known_config("LlamaForCausalLM", "generate", 1, 512, 1, registry=registry).is_known
    emb = check_known_config(
        "XLMRobertaModel", "rerank", shapes=[(512, 1)], platform="x86_64", registry=registry
    )
    assert emb.is_known and emb.env == {}
    assert f"MODEL_CONFIG_FILE={path}" in check_known_config("BertModel", "embed", registry=registry).message


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("models: [", "not valid YAML"),
        ("[]", "expected a mapping with a 'models' list"),
        (
            "models: [{name: x, architecture: A, platforms: {x86_64: []}, color: red}]",
            "unknown keys ['color']",
        ),
        ("models: [{name: x, architecture: A, platforms: {arm: []}}]", "platform 'arm' is not one of"),
        ("models: [{name: x, architecture: A, task: chat, platforms: {x86_64: []}}]", "task 'chat'"),
        (
            "models: [{name: x, architecture: A, platforms: {x86_64: [{max_model_len: 0, max_num_seqs: 1}]}}"
            "]",
            "models[0] (x): platforms.x86_64[0]: 'max_model_len' must be a positive integer",
        ),
        (
            "models: [{name: x, architecture: A, task: embed, platforms: {x86_64: [{warmup_shapes: [[64]]}]}}"
            "]",
            "warmup shape [64] is not [prompt_len, batch_size]",
        ),
        (
            "models: [{name: x, architecture: A, task: embed, platforms: {x86_64: [{max_num_seqs: 4}]}}]",
            "unknown keys ['max_num_seqs'] for task embed",
        ),
        (
            "models: [{name: x, architecture: A, platforms: {x86_64: [{max_model_len: 64, max_num_seqs: 1,"
            " env: {SENDNN_INFERENCE_USE_CB: '1'}}]}}]",
            "contract variables are read before the registry",
        ),
    ],
)
def test_bad_files_are_refused_naming_the_entry(text, fragment):
    with pytest.raises(ContractError, match=r"known\.yaml") as e:
        parse_registry(text, "known.yaml")
    assert fragment in str(e.value)


def test_settings_read_the_variables_and_their_aliases():
    assert registry_settings({}) == (False, "")
    assert registry_settings({"SENDNN_INFERENCE_REQUIRE_KNOWN_CONFIG": "1"}) == (True, "")
    assert registry_settings({"SENDNN_INFERENCE_MODEL_CONFIG_FILE": "/x.yaml"}) == (False, "/x.yaml")
    with pytest.raises(ContractError, match="use SENDNN_INFERENCE_MODEL_CONFIG_FILE"):
        registry_settings({"VLLM_SPYRE_MODEL_CONFIG_FILE": "/x.yaml"})
    with pytest.raises(ContractError, match="SENDNN_INFERENCE_REQUIRE_KNOWN_CONFIG='maybe'"):
        registry_settings({"SENDNN_INFERENCE_REQUIRE_KNOWN_CONFIG": "maybe"})
    with pytest.raises(ContractError, match="cannot read it"):
        load_registry("/nonexistent/known.yaml")


# ---- the pooling environment ----------------------------------------------------------------------


def test_pooling_shapes_zip_prompt_lens_with_batch_sizes_and_ignore_new_tokens():
    s = read_pooling_environment(
        {
            "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "128,64",
            "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "4,16",
            "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "20",  # a decoder's list of another length: ignored
            "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
        }
    )
    assert s.shapes == (Shape(64, 0, 16), Shape(128, 0, 4))
    assert (s.max_model_len, s.max_num_seqs, s.backend, s.use_cb) == (128, 16, "eager", False)


@pytest.mark.parametrize(
    ("environ", "flags", "fragment"),
    [
        ({"SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64,128"}, {}, "warmup lists differ in length"),
        ({"SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "100"}, {}, "100 is not a multiple of 64"),
        ({"SENDNN_INFERENCE_USE_CB": "1"}, {}, "pooling models run on static warm-up shapes"),
        ({}, {"tensor_parallel_size": 2}, "pooling models run on one card"),
        ({}, {"max_model_len": 128}, "--max-model-len=128 is larger than the longest warm-up prompt length"),
        ({"SENDNN_INFERENCE_DYNAMO_BACKEND": "gpu"}, {}, "'gpu' is not one of sendnn, inductor, eager"),
        (
            {"SENDNN_INFERENCE_KV_CACHE_DTYPE": "bfloat16"},
            {},
            "SENDNN_INFERENCE_KV_CACHE_DTYPE='bfloat16' has no effect on a pooling model, which keeps no KV "
            "cache; leave it auto",
        ),
        (
            {"SENDNN_INFERENCE_KV_CACHE_DTYPE": "bfloat16"},
            {"kv_cache_dtype": "float32"},  # the flag wins, and is named
            "--kv-cache-dtype='float32' has no effect on a pooling model",
        ),
    ],
)
def test_pooling_environment_refusals(environ, flags, fragment):
    with pytest.raises(ContractError) as e:
        read_pooling_environment(environ, EngineFlags(**flags))
    assert fragment in str(e.value)


def test_task_names():
    assert check_task(None) is None and check_task("auto") is None and check_task("rerank") == "rerank"
    with pytest.raises(ContractError, match="--task='classify' is not one of auto, generate, embed"):
        check_task("classify")


# ---- the runtime at start-up ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return write_tiny_cross_encoder(tmp_path_factory.mktemp("ce"), "bert", seed=0)


def test_runtime_check_warns_or_refuses(cross_encoder, caplog):
    env = {"SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "512", "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "1"}
    config = load_config(cross_encoder, environ=env, task="score")
    with caplog.at_level("WARNING"):
        verdict = check_known_configuration(config, environ=env)
    assert not verdict.is_known
    assert "REQUIRE_KNOWN_CONFIG=1 to refuse it" in caplog.text
    with pytest.raises(ContractError, match=r"warmup shape \[256, 1\] instead of \[512, 1\]"):
        check_known_configuration(config, environ={**env, "SENDNN_INFERENCE_REQUIRE_KNOWN_CONFIG": "1"})
    known = load_config(cross_encoder, environ={}, task="rerank")  # 64 x 1
    assert check_known_configuration(known, environ={"SENDNN_INFERENCE_REQUIRE_KNOWN_CONFIG": "1"}).is_known


def test_serve_refuses_an_unknown_configuration_in_one_line(cross_encoder, tmp_path):
    env = {
        **os.environ,
        "SENDNN_INFERENCE_REQUIRE_KNOWN_CONFIG": "1",
        "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
        "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64,192",
        "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "4,4",
    }
    argv = [sys.executable, "-m", "spyre_runtime.cli", "serve", str(cross_encoder), "--port", "17999"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("spyre-runtime: error: unknown configuration: ")
    assert f"{cross_encoder.name} (BertForSequenceClassification)" in last
    assert "nearest known: tiny-cross-encoder" in last and "[256, 4] instead of [192, 4]" in last
    # the same start-up with a registry file that lists it goes past the check (and --task embed is refused)
    known = tmp_path / "known.yaml"
    cfg = json.loads((cross_encoder / "config.json").read_text())
    known.write_text(
        "models:\n  - {name: ce, architecture: BertForSequenceClassification, task: score,\n"
        f"     match: {{hidden_size: {cfg['hidden_size']}}},\n"
        "     platforms: {x86_64: [{warmup_shapes: [[64, 4], [192, 4]]}], ppc64le: [], s390x: []}}\n"
    )
    env["SENDNN_INFERENCE_MODEL_CONFIG_FILE"] = str(known)
    done = subprocess.run([*argv, "--task", "embed"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--task=embed" in done.stderr and "is a cross-encoder" in done.stderr
    assert "unknown configuration" not in done.stderr


def test_start_up_applies_the_known_configurations_env_overrides(cross_encoder, tmp_path, monkeypatch):
    from spyre_runtime.cli import _config, build_parser

    known = tmp_path / "known.yaml"
    known.write_text(
        "models:\n  - {name: ce, architecture: BertForSequenceClassification, task: score,\n"
        "     platforms: {x86_64: [{warmup_shapes: [[64, 1]], env: {SPYRE_TEST_OVERRIDE: from-registry,"
        " SPYRE_TEST_KEPT: from-registry}}]}}\n"
    )
    monkeypatch.setenv("SENDNN_INFERENCE_MODEL_CONFIG_FILE", str(known))
    monkeypatch.setenv("SENDNN_INFERENCE_REQUIRE_KNOWN_CONFIG", "1")
    monkeypatch.setenv("SPYRE_TEST_KEPT", "from-pod")
    monkeypatch.delenv("SPYRE_TEST_OVERRIDE", raising=False)
    monkeypatch.setattr("spyre_contract.registry.current_platform", lambda: "x86_64")
    config = _config(build_parser().parse_args(["serve", str(cross_encoder)]))
    assert config.task == "score" and config.shapes == (Shape(64, 0, 1),)
    assert os.environ["SPYRE_TEST_OVERRIDE"] == "from-registry"
    assert os.environ["SPYRE_TEST_KEPT"] == "from-pod"  # the pod's own setting wins
