"""The known-configurations registry and the memory plan for the families of issue 27 (pure: no torch):
sendnn-inference's published limits are known and nothing past them, an FP8 checkpoint only matches its own
narrower list, the memory plan reads each family's dimensions and refuses what cannot fit on the cards;
which decoder configurations the runtime refuses at start-up."""

import re

import pytest
from spyre_contract import ContractError
from spyre_contract.architectures import check_decoder_config, kv_window
from spyre_contract.environment import EnvironmentSettings
from spyre_contract.memory import GIB, ModelDims, plan_memory
from spyre_contract.registry import check_known_config

FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed"}
FP8_WEIGHTS = {
    "config_groups": {"group_0": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}
}
GRANITE_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}
CONFIGS = {
    "granite-3.3-8b": ("GraniteForCausalLM", GRANITE_8B | {"vocab_size": 49159, "intermediate_size": 12800}),
    "granite-3.3-8b-fp8": (
        "GraniteForCausalLM",
        GRANITE_8B | {"vocab_size": 49159, "quantization_config": FP8},
    ),
    "granite-4-8b-dense": ("GraniteForCausalLM", GRANITE_8B | {"vocab_size": 100352}),
    "granite-4-8b-hybrid": (
        "GraniteMoeHybridForCausalLM",
        GRANITE_8B
        | {
            "vocab_size": 100352,
            "model_type": "granitemoehybrid",
            "intermediate_size": 512,
            "shared_intermediate_size": 12800,
        },
    ),
    "granite-4.1-8b-fp8": (
        "GraniteForCausalLM",
        GRANITE_8B | {"vocab_size": 100352, "quantization_config": FP8},
    ),
    "granite-4.1-30b": ("GraniteForCausalLM", GRANITE_8B | {"num_hidden_layers": 64, "vocab_size": 100352}),
    "swa-20b": ("GraniteSWAForCausalLM", GRANITE_8B | {"num_hidden_layers": 44, "vocab_size": 100352}),
    "llama-3.1-8b": ("LlamaForCausalLM", GRANITE_8B | {"num_hidden_layers": 32, "vocab_size": 128256}),
    "granite-vision-2b": (
        "LlavaNextForConditionalGeneration",
        {
            "text_config": {
                "hidden_size": 2048,
                "num_hidden_layers": 40,
                "num_attention_heads": 32,
                "vocab_size": 49156,
            }
        },
    ),
    "mistral-small-3.2": (
        "Mistral3ForConditionalGeneration",
        {"text_config": {"hidden_size": 5120, "num_hidden_layers": 40, "max_position_embeddings": 131072}},
    ),
    "ministral-3-14b": (
        "Mistral3ForConditionalGeneration",
        {"text_config": {"hidden_size": 5120, "num_hidden_layers": 40, "max_position_embeddings": 262144}},
    ),
}


def verdict(model: str, tp: int, max_model_len: int, max_num_seqs: int, platform: str = "s390x"):
    arch, config = CONFIGS[model]
    return check_known_config(
        arch,
        tensor_parallel_size=tp,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        platform=platform,
        model_config=config,
    )


@pytest.mark.parametrize(
    ("model", "tp", "max_model_len", "max_num_seqs", "platform", "known"),
    [
        # sendnn-inference model_configs.yaml (5af45f6a): what it publishes is known ...
        ("granite-3.3-8b", 1, 8192, 4, "s390x", True),
        ("granite-3.3-8b", 4, 32768, 32, "ppc64le", True),
        ("granite-4-8b-dense", 2, 8192, 4, "s390x", True),
        ("granite-4-8b-hybrid", 1, 3072, 16, "s390x", True),
        ("granite-4.1-8b-fp8", 4, 16384, 4, "s390x", True),
        ("granite-4.1-30b", 4, 32768, 32, "s390x", True),
        ("swa-20b", 4, 32768, 32, "x86_64", True),
        ("llama-3.1-8b", 1, 3072, 16, "ppc64le", True),
        ("granite-vision-2b", 2, 16384, 16, "s390x", True),
        ("mistral-small-3.2", 2, 8192, 32, "x86_64", True),
        ("ministral-3-14b", 1, 4096, 32, "s390x", True),
        # ... and nothing past it
        ("granite-3.3-8b-fp8", 1, 8192, 4, "s390x", False),  # the bf16 model's entry, not the FP8 one's
        ("granite-3.3-8b", 1, 8192, 8, "s390x", False),
        ("granite-4.1-30b", 1, 32768, 32, "s390x", False),
        ("llama-3.1-8b", 1, 3072, 16, "s390x", False),  # published for x86_64 and ppc64le only
        ("mistral-small-3.2", 1, 4096, 32, "x86_64", False),  # Ministral's TP 1, not Mistral-Small's
    ],
)
def test_published_configurations(model, tp, max_model_len, max_num_seqs, platform, known):
    result = verdict(model, tp, max_model_len, max_num_seqs, platform)
    assert result.is_known == known, result.message


def test_tp4_entries_carry_the_device_environment():
    env = verdict("granite-4.1-30b", 4, 32768, 32).env
    assert env == {
        "VLLM_DT_MAX_BATCH_TKV_LIMIT": "131072",
        "FLEX_HDMA_P2PSIZE": "268435456",
        "FLEX_HDMA_COLLSIZE": "33554432",
    }


def test_qwen3_4b_has_no_published_decoder_configuration():
    qwen = {"hidden_size": 2560, "num_hidden_layers": 36}
    result = check_known_config("Qwen3ForCausalLM", max_model_len=4096, max_num_seqs=4, model_config=qwen)
    assert not result.is_known and "model not in the registry" in result.message


def test_memory_dims_of_the_families():
    qwen3_4b = {
        "hidden_size": 2560,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 9728,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    }
    dims = ModelDims.from_config(qwen3_4b)
    assert dims.head_dim == 128 and abs(dims.num_params() - 4.02e9) < 0.02e9  # Qwen3-4B: 4.0B parameters
    hybrid = ModelDims.from_config(CONFIGS["granite-4-8b-hybrid"][1])
    assert hybrid.intermediate == 12800  # its dense (shared) MLP, not the expert width
    vision = ModelDims.from_config(CONFIGS["granite-vision-2b"][1])
    assert (vision.hidden, vision.layers) == (2048, 40)
    fp8 = ModelDims.from_config(CONFIGS["granite-4.1-8b-fp8"][1])
    assert fp8 == ModelDims.from_config(CONFIGS["granite-4-8b-dense"][1])  # counted at the serving dtype


@pytest.mark.parametrize(("tp", "fits"), [(1, False), (4, True)])
def test_memory_plan_refuses_granite_41_30b_on_one_card(tp, fits):
    """granite-4.1-30b at 32768 x 32 (its published TP 4 configuration) on 128 GiB cards in bf16: the KV
    cache alone (64 layers, 8 KV heads of 128) is 256 GiB on one card, 64 GiB per card on four."""
    dims = ModelDims.from_config(CONFIGS["granite-4.1-30b"][1] | {"intermediate_size": 12800})
    settings = EnvironmentSettings(use_cb=True, max_model_len=32768, max_num_seqs=32, tensor_parallel_size=tp)
    plan = plan_memory(dims, settings, 128 * GIB, "card", 2)
    assert plan.fits == fits
    if not fits:
        assert "the largest consumer is the KV cache" in plan.refusal()


@pytest.mark.parametrize(
    ("config", "max_model_len", "error"),
    [
        ({"architectures": ["Qwen3ForCausalLM"]}, 4096, None),
        ({"architectures": ["GraniteSWAForCausalLM"], "sliding_window": 128}, 32768, None),
        ({"architectures": ["GraniteForCausalLM"], "quantization_config": FP8 | FP8_WEIGHTS}, 4096, None),
        ({"architectures": []}, 4096, "names no architecture"),
        ({"architectures": ["GraniteMoeHybridForCausalLM"], "layer_types": ["attention"] * 4}, 4096, None),
        # granite-4 "H": its Mamba layers are the hybrid path's to accept or refuse (runtime hybrid.py)
        (
            {"architectures": ["GraniteMoeHybridForCausalLM"], "layer_types": ["mamba", "attention"]},
            4096,
            None,
        ),
        (
            {"architectures": ["Phi3ForCausalLM"]},
            4096,
            "architecture Phi3ForCausalLM is not supported; supported:",
        ),
        (
            {"architectures": ["MistralForCausalLM"], "sliding_window": 4096},
            8192,
            "--max-model-len 4096 or less",
        ),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, 4096, None),
        ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True}, 4096, "use_sliding_window"),
        ({"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "awq"}}, 64, "awq"),
        (
            {
                "architectures": ["LlamaForCausalLM"],
                "quantization_config": FP8 | {"quantization_status": "frozen"},
            },
            64,
            "quantization_status",
        ),
    ],
)
def test_decoder_configs_refused_at_start_up(config, max_model_len, error):
    if error is None:
        assert check_decoder_config(config, max_model_len) == config["architectures"][0]
    else:
        with pytest.raises(ContractError, match=re.escape(error)):
            check_decoder_config(config, max_model_len)


def test_kv_window_frees_blocks_only_when_every_layer_slides():
    swa = {"architectures": ["GraniteSWAForCausalLM"], "sliding_window": 128}
    assert kv_window(swa | {"layer_types": ["sliding_attention"] * 4})[0] == 128
    window, note = kv_window(swa | {"layer_types": ["full_attention", "sliding_attention"]})
    assert window == 0 and "blocks are kept" in note
    assert kv_window({"architectures": ["LlamaForCausalLM"]}) == (0, "")
