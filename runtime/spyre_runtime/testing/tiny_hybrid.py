"""Seeded random tiny hybrid (Mamba) decoders for tests, saved as safetensors folders with a tokenizer
(models.build_tokenizer's): HF transformers' BambaForCausalLM and GraniteMoeHybridForCausalLM (granite-4 "H":
Mamba-2 layers beside attention layers, dense, no position embedding, Granite's multipliers)."""

from __future__ import annotations

from pathlib import Path

ARCHES = ("bamba", "granitemoehybrid")


def write_tiny_hybrid(
    out_dir: str | Path,
    tokenizer,
    arch: str = "bamba",
    seed: int = 0,
    num_layers: int = 4,
    attn_layers: tuple[int, ...] = (1,),
    hidden: int = 64,
    chunk_size: int = 16,
) -> Path:
    """Layers `attn_layers` are attention, the others Mamba-2 (4 heads of 32, state 16, conv 4). A small
    `chunk_size` (the SSD scan's, mamba_chunk_size) makes short prompts cross chunks of the scan too."""
    import torch
    from transformers import (
        BambaConfig,
        BambaForCausalLM,
        GraniteMoeHybridConfig,
        GraniteMoeHybridForCausalLM,
    )

    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "mamba_n_heads": 4,
        "mamba_d_head": hidden * 2 // 4,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": chunk_size,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "initializer_range": 0.25,  # decisive greedy choices (see models.write_tiny_model)
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch == "bamba":
        config = BambaConfig(**common, intermediate_size=hidden * 2, attn_layer_indices=list(attn_layers))
        cls = BambaForCausalLM
    elif arch == "granitemoehybrid":
        kinds = ["attention" if i in attn_layers else "mamba" for i in range(num_layers)]
        config = GraniteMoeHybridConfig(
            **common,
            shared_intermediate_size=hidden * 2,
            num_local_experts=0,
            layer_types=kinds,
            position_embedding_type="nope",
            embedding_multiplier=2.0,
            logits_scaling=1.5,
            residual_multiplier=0.5,
            attention_multiplier=0.125,
        )
        cls = GraniteMoeHybridForCausalLM
    else:
        raise ValueError(f"--arch {arch!r} is not one of {', '.join(ARCHES)}")
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
