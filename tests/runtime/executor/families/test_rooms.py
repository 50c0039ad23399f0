"""The family registry (spyre_contract/architectures.py) and its rooms (executor/families/): every room the
registry names exists and offers hooks, what a family supports is read from its record (a hybrid spec only
for an architecture declaring hybrid state, the sliding window only where declared, FP8 and batching modes
refused where not supported), and the rooms' FMS overrides are the ones FMS 1.13.1 needs."""

import pytest
from spyre_contract import ContractError
from spyre_contract.architectures import (
    ARCHITECTURES,
    DECODER_ARCHITECTURES,
    check_batching,
    check_decoder_config,
    kv_window,
)
from spyre_contract.hybrid import HYBRID_ARCHITECTURES, HybridSpec
from spyre_runtime.executor.families import rooms

HOOKS = ("fms_overrides", "load_model", "split_model", "attach_state")
FP8 = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}},
}
BAMBA = {
    "architectures": ["BambaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "attn_layer_indices": [1],
    "mamba_n_heads": 4,
    "mamba_d_head": 32,
    "mamba_d_state": 16,
}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_room_the_registry_names_exists_and_offers_hooks(arch):
    family = rooms.family_of_config({"architectures": [arch]})
    assert family.record is ARCHITECTURES[arch]
    if ARCHITECTURES[arch].room:
        assert family.room is not None and any(family.hook(h) for h in HOOKS)
    else:
        assert family.room is None
        assert family.fms_overrides({"architectures": [arch]}) == {}
        assert family.split_model("m", 1) == ("m", None)


def test_the_declared_capabilities_pick_the_rooms_hooks():
    assert set(HYBRID_ARCHITECTURES) == {"BambaForCausalLM", "GraniteMoeHybridForCausalLM"}
    for arch in HYBRID_ARCHITECTURES:
        assert rooms.family_of_config({"architectures": [arch]}).hook("attach_state") is not None
    vision = [a for a, r in ARCHITECTURES.items() if r.vision]
    assert vision == ["LlavaNextForConditionalGeneration"]
    assert rooms.family_of_config({"architectures": vision}).hook("split_model") is not None
    assert DECODER_ARCHITECTURES["Qwen3ForCausalLM"] == "qwen3"


def test_a_hybrid_spec_is_read_only_for_an_architecture_declaring_hybrid_state():
    assert HybridSpec.from_config(BAMBA).mamba_layers == (0,)
    assert HybridSpec.from_config(BAMBA | {"architectures": ["LlamaForCausalLM"]}) is None
    assert HybridSpec.from_config(BAMBA | {"architectures": ["SomethingForCausalLM"]}) is None


def test_the_sliding_window_is_freed_only_where_declared():
    slides = {"sliding_window": 64, "layer_types": ["sliding_attention"] * 2}
    assert kv_window({"architectures": ["GraniteSWAForCausalLM"]} | slides)[0] == 64
    assert kv_window({"architectures": ["MistralForCausalLM"]} | slides) == (0, "")


def test_fp8_and_batching_modes_are_refused_where_the_registry_says_so(monkeypatch):
    assert check_decoder_config({"architectures": ["LlamaForCausalLM"], "quantization_config": FP8}, 512)
    with pytest.raises(ContractError, match="BambaForCausalLM is not supported as an FP8 checkpoint"):
        check_decoder_config(BAMBA | {"quantization_config": FP8}, 512)
    check_batching({"architectures": ["LlamaForCausalLM"]}, use_cb=True)
    static_only = ARCHITECTURES["LlamaForCausalLM"].__class__("static only", continuous=False)
    monkeypatch.setitem(ARCHITECTURES, "StaticOnlyForCausalLM", static_only)
    check_batching({"architectures": ["StaticOnlyForCausalLM"]}, use_cb=False)
    with pytest.raises(
        ContractError, match="does not run continuous batching; set SENDNN_INFERENCE_USE_CB=0"
    ):
        check_batching({"architectures": ["StaticOnlyForCausalLM"]}, use_cb=True)


def test_the_rooms_give_fms_what_its_param_builders_miss():
    qwen3 = rooms.family_of_config({"architectures": ["Qwen3ForCausalLM"]})
    assert qwen3.fms_overrides({"rope_parameters": {"rope_theta": 5e5}}) == {"rope_theta": 5e5}
    assert qwen3.fms_overrides({"rope_theta": 1e4}) == {"rope_theta": 1e4}
    assert qwen3.fms_overrides({}) == {}
    granite4 = rooms.family_of_config({"architectures": ["GraniteMoeHybridForCausalLM"]})
    assert granite4.fms_overrides({"pad_token_id": 7}) == {"pad_id": 7}
    assert granite4.fms_overrides({}) == {}
