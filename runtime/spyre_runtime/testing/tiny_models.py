"""Seeded random tiny decoders of the newer families (issue 27): Qwen3 (q/k norms), Mistral, Granite 4
dense (published as GraniteMoeHybridForCausalLM with every layer attention and no experts), the sliding-window
Granite (GraniteSWAForCausalLM: sliding and full attention layers, attention sinks) and an FP8 checkpoint of a
tiny model in fms-model-optimizer's format (llm-compressor's compressed-tensors, `format:
float-quantized`)."""

from __future__ import annotations

import json
from pathlib import Path

# the window of the tiny sliding-window Granite: short, so test prompts cross it
TINY_WINDOW = 64


def family_model(arch: str, common: dict, num_layers: int):
    """(config, model class) of one of the families below, from the llama-style `common` settings."""
    from transformers import (
        GraniteMoeHybridConfig,
        GraniteMoeHybridForCausalLM,
        GraniteSWAConfig,
        GraniteSWAForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    granite = {
        "embedding_multiplier": 2.0,
        "logits_scaling": 1.5,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.125,
    }
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    if arch == "qwen3":  # FMS rounds Qwen3's (and Mistral's) MLP width up to a multiple of 256
        qwen = common | {"intermediate_size": 256}
        return Qwen3Config(**qwen, head_dim=head_dim), Qwen3ForCausalLM
    if arch == "mistral":  # no sliding window: FMS's mistral attends to every token; MLP as Qwen3's
        config = MistralConfig(**common | {"intermediate_size": 256}, head_dim=head_dim, sliding_window=None)
        return config, MistralForCausalLM
    if arch == "granite4":
        config = GraniteMoeHybridConfig(
            **common,
            **granite,
            layer_types=["attention"] * num_layers,
            num_local_experts=0,
            num_experts_per_tok=0,
            shared_intermediate_size=common["intermediate_size"],
            position_embedding_type="rope",
        )
        return config, GraniteMoeHybridForCausalLM
    if arch in ("granite_swa", "granite_swa_all"):
        # granite_swa_all: every layer sliding, so KV blocks that leave the window can be freed
        kinds = ["sliding_attention"] * num_layers
        if arch == "granite_swa":
            kinds[0] = "full_attention"
        config = GraniteSWAConfig(**common, **granite, sliding_window=TINY_WINDOW, layer_types=kinds)
        return config, GraniteSWAForCausalLM
    raise ValueError(f"--arch {arch!r} is not a family of tiny_models")


FAMILIES = ("qwen3", "granite4", "granite_swa", "granite_swa_all", "mistral")


def randomize_sinks(model, seed: int) -> None:
    """HF initializes attention sinks to zero; give them values so parity tests exercise them."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if name.endswith("sinks"):
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=gen))


# ---- FP8 checkpoints -------------------------------------------------------------------------------------

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def fp8_quantization_config() -> dict:
    """What llm-compressor writes for FP8-dynamic (fms-model-optimizer's FP8 recipe): weights per output
    channel, static; activations per token, dynamic; lm_head left alone."""
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**scheme, "strategy": "channel", "dynamic": False},
                "input_activations": {**scheme, "strategy": "token", "dynamic": True},
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def quantize_fp8(model_dir: str | Path) -> Path:
    """Rewrites a folder's linear weights (every `*_proj`/`*_linear` weight of a decoder layer) as
    float8_e4m3fn with a per-output-channel `weight_scale` [out, 1] (float32, weight = fp8 * scale) and adds
    the quantization_config. Embeddings, norms and lm_head stay as they are."""
    import torch
    from safetensors.torch import load_file, save_file

    out = Path(model_dir)
    path = out / "model.safetensors"
    state = load_file(str(path))
    quantized = {}
    for name, tensor in state.items():
        if ".layers." in name and name.endswith(".weight") and tensor.dim() == 2:
            w = tensor.to(torch.float32)
            scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
            quantized[name] = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            quantized[name[: -len("weight")] + "weight_scale"] = scale
        else:
            quantized[name] = tensor
    save_file(quantized, str(path), metadata={"format": "pt"})
    config_path = out / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg["quantization_config"] = fp8_quantization_config()
    config_path.write_text(json.dumps(cfg, indent=2))
    return out
