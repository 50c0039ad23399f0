"""Which decoder architectures the runtime serves, read from a model's config.json before anything loads: an
architecture we do not serve, a form of one we do not (Granite 4 with experts, a Mistral window shorter than
the model length) or a quantization we cannot apply stops start-up with one line naming it and what is
supported. Pure dict checks: the runtime calls them at start-up, the operator may call them before a pod.

FP8 checkpoints: fms-model-optimizer's format, which is llm-compressor's compressed-tensors with
`format: float-quantized` and `quantization_status: compressed` (one group, float weights of 8 bits, a
`weight_scale` beside each quantized `weight`; FMS 1.13.1 hands such configs to fms_mo's `fp8` linear type,
`_infer_quantization_config`). The runtime dequantizes them at load (executor/loader.py)."""

from __future__ import annotations

from collections.abc import Mapping

from spyre_contract.environment import ContractError

# HF architecture -> what serves it (FMS 1.13.1 model code unless said otherwise)
DECODER_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "GraniteForCausalLM": "granite (3.x)",
    # Granite 4 dense (every layer attention) through FMS's granite_moe_hybrid; with Mamba layers
    # (granite-4 "H") through runtime/spyre_runtime/hybrid.py, which decides what of those it serves
    "GraniteMoeHybridForCausalLM": "granite_moe_hybrid (Granite 4: no experts)",
    "GraniteSWAForCausalLM": "granite_swa (sliding-window and full attention layers, attention sinks)",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral (a sliding_window, if any, at least --max-model-len)",
    "BambaForCausalLM": "bamba (Mamba-2 beside attention; runtime/spyre_runtime/hybrid.py)",
    "LlavaNextForConditionalGeneration": "llava_next (granite-vision; executor/vision.py)",
}


def supported_line() -> str:
    return "supported: " + ", ".join(DECODER_ARCHITECTURES)


def check_decoder_config(model_config: Mapping, max_model_len: int) -> str:
    """The config's first architecture, or ContractError (one line) when we cannot serve it as configured."""
    architectures = model_config.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch is None:
        raise ContractError(
            f"config.json names no architecture (its `architectures` is empty); {supported_line()}"
        )
    if arch not in DECODER_ARCHITECTURES:
        raise ContractError(f"architecture {arch} is not supported; {supported_line()}")
    if arch == "GraniteMoeHybridForCausalLM" and int(model_config.get("num_local_experts") or 0) > 0:
        raise ContractError(
            f"architecture {arch} with num_local_experts={model_config['num_local_experts']} is not "
            "supported: FMS 1.13.1's granite_moe_hybrid builds the dense form (no experts) only"
        )
    window = model_config.get("sliding_window")
    if arch == "MistralForCausalLM" and window and int(window) < max_model_len:
        raise ContractError(
            f"architecture {arch} with sliding_window={window} is not supported with --max-model-len "
            f"{max_model_len}: FMS's mistral attends to every token; use --max-model-len {window} or less"
        )
    if arch == "Qwen3ForCausalLM" and model_config.get("use_sliding_window"):
        raise ContractError(
            f"architecture {arch} with use_sliding_window=true is not supported (FMS's qwen3)"
        )
    check_quantization(model_config)
    return arch


def kv_window(model_config: Mapping) -> tuple[int, str]:
    """(window, what the KV cache does about it): the sliding window when every attention layer has one, so
    KV blocks before every running sequence's window can be freed; else 0 (a full-attention layer reads
    every block)."""
    window = int(model_config.get("sliding_window") or 0)
    kinds = model_config.get("layer_types") or []
    arch = (model_config.get("architectures") or [""])[0]
    if arch != "GraniteSWAForCausalLM" or not window:
        return 0, ""
    if not kinds or any(kind != "sliding_attention" for kind in kinds):
        return (
            0,
            f"sliding window {window} on some layers: KV blocks are kept (full-attention layers read them)",
        )
    return window, (
        f"sliding window {window} on every layer: KV blocks before a running sequence's window are freed; "
        "prefix caching stays correct (a cached prompt block keeps its tokens' K/V until evicted)"
    )


def is_fp8(model_config: Mapping) -> bool:
    quant = model_config.get("quantization_config")
    return bool(quant) and quant.get("format") == "float-quantized"


def check_quantization(model_config: Mapping) -> None:
    """No quantization_config, or an FP8 one in fms-model-optimizer's format; else ContractError."""
    quant = model_config.get("quantization_config")
    if not quant:
        return
    where = "config.json quantization_config"
    fmt, method = quant.get("format"), quant.get("quant_method")
    if method != "compressed-tensors" or fmt != "float-quantized":
        raise ContractError(
            f"{where}: quant_method={method!r} format={fmt!r} is not supported; supported: FP8 "
            "checkpoints of fms-model-optimizer (quant_method compressed-tensors, format float-quantized)"
        )
    if quant.get("quantization_status", "compressed") != "compressed":
        raise ContractError(f"{where}: quantization_status must be 'compressed' (weights stored quantized)")
    groups = quant.get("config_groups") or {}
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ContractError(f"{where}: config_groups.{name}.weights must be float with num_bits 8 (FP8)")
        if weights.get("strategy") not in ("channel", "tensor"):
            raise ContractError(
                f"{where}: config_groups.{name}.weights.strategy={weights.get('strategy')!r}; "
                "supported: channel, tensor"
            )
