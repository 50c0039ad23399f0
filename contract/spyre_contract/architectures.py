"""Which decoder architectures the runtime serves, read from a model's config.json before anything loads: an
architecture we do not serve, a form of one we do not (Granite 4 with experts, a Mistral window shorter than
the model length) or a quantization we cannot apply stops start-up with one line naming it and what is
supported. Pure dict checks: the runtime calls them at start-up, the operator may call them before a pod.

FP8 checkpoints: fms-model-optimizer's format, which is llm-compressor's compressed-tensors with
`format: float-quantized` and `quantization_status: compressed` (one group, float weights of 8 bits, a
`weight_scale` beside each quantized `weight`; FMS 1.13.1 hands such configs to fms_mo's `fp8` linear type,
`_infer_quantization_config`). The runtime dequantizes them at load (executor/families/fp8.py).

The registry (`ARCHITECTURES`) declares, per architecture, what the runtime supports (batching modes, FP8,
tensor parallelism, hybrid state, vision) and which room of the runtime's executor/families/ holds what is
specific to the family. The runtime reads it; the operator may read it; neither imports the other."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from spyre_contract.environment import ENV_PREFIX, ContractError


@dataclass(frozen=True)
class Architecture:
    """What the runtime supports of one HF architecture, declared here rather than found by branches through
    the executor. `room`: the module of runtime/spyre_runtime/executor/families/ holding what is specific to
    the family (its FMS overrides, its own loading, its per-sequence state, its vision tower); "" for a
    decoder FMS loads and runs as it is."""

    serves: str  # the FMS model code that serves it (1.13.1 unless said otherwise)
    room: str = ""
    static: bool = True  # static batching over the warm-up shapes
    continuous: bool = True  # continuous batching
    fp8: bool = True  # FP8 checkpoints (dequantized at load, executor/families/fp8.py)
    hybrid_state: bool = False  # Mamba-2 layers: one state slot per sequence beside the KV cache (hybrid.py)
    vision: bool = False  # an image-text model: a vision tower runs beside the language model
    sliding_window: bool = False  # a sliding window the KV cache frees blocks behind (kv_window)


# The registry: HF architecture -> what serves it and what it supports. Adding a family is one line here, its
# room (when it needs one) and its tiny-model writer (runtime/spyre_runtime/testing/).
ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama"),
    "GraniteForCausalLM": Architecture("granite (3.x)"),
    # Granite 4 dense (every layer attention) through FMS's granite_moe_hybrid; with Mamba layers
    # (granite-4 "H") through the hybrid room, which decides what of those it serves (hybrid.py)
    "GraniteMoeHybridForCausalLM": Architecture(
        "granite_moe_hybrid (Granite 4: no experts)", room="granite4", hybrid_state=True
    ),
    "GraniteSWAForCausalLM": Architecture(
        "granite_swa (sliding-window and full attention layers, attention sinks)", sliding_window=True
    ),
    "Qwen3ForCausalLM": Architecture("qwen3", room="qwen3"),
    "MistralForCausalLM": Architecture("mistral (a sliding_window, if any, at least --max-model-len)"),
    "BambaForCausalLM": Architecture(
        "bamba (Mamba-2 beside attention; hybrid.py)", room="hybrid", hybrid_state=True, fp8=False
    ),
    "LlavaNextForConditionalGeneration": Architecture(
        "llava_next (granite-vision; executor/families/vision.py)", room="vision", vision=True, fp8=False
    ),
}
# encoders (pooling tasks: embed, score), by config.json's model_type: the FMS family that runs them
# (their room: executor/families/pooling.py)
ENCODER_MODEL_TYPES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta"}
# HF architecture -> what serves it, for messages
DECODER_ARCHITECTURES = {name: arch.serves for name, arch in ARCHITECTURES.items()}


def architecture_of(model_config: Mapping) -> str:
    """config.json's first architecture ("" when it names none)."""
    return (model_config.get("architectures") or [""])[0]


def lookup(model_config: Mapping) -> Architecture | None:
    """The registry's record of config.json's architecture (None: not a decoder we serve)."""
    return ARCHITECTURES.get(architecture_of(model_config))


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
    if is_fp8(model_config) and not ARCHITECTURES[arch].fp8:
        raise ContractError(
            f"architecture {arch} is not supported as an FP8 checkpoint (its weights in bf16 are)"
        )
    return arch


def check_batching(model_config: Mapping, use_cb: bool) -> None:
    """ContractError when the registry says the architecture does not run the batching asked for."""
    record = lookup(model_config)
    if record is None:
        return
    mode, supported = ("continuous", record.continuous) if use_cb else ("static", record.static)
    if not supported:
        raise ContractError(
            f"architecture {architecture_of(model_config)} does not run {mode} batching; "
            f"set {ENV_PREFIX}USE_CB={0 if use_cb else 1}"
        )


def kv_window(model_config: Mapping) -> tuple[int, str]:
    """(window, what the KV cache does about it): the sliding window when every attention layer has one, so
    KV blocks before every running sequence's window can be freed; else 0 (a full-attention layer reads
    every block)."""
    window = int(model_config.get("sliding_window") or 0)
    kinds = model_config.get("layer_types") or []
    record = lookup(model_config)
    if record is None or not record.sliding_window or not window:
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


def checkpoint_dtype(model_config: Mapping) -> str | None:
    """The dtype config.json names: `dtype` (transformers >= 4.56 writes it) or `torch_dtype` (before)."""
    named = model_config.get("dtype") or model_config.get("torch_dtype")
    return None if named is None else str(named)


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
