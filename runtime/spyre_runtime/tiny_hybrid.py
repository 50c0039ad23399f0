"""A seeded random tiny hybrid (Mamba) decoder for tests: HF transformers' BambaForCausalLM (Mamba-2 layers
beside attention layers), saved as a safetensors folder with a tokenizer (models.build_tokenizer's)."""

from __future__ import annotations

from pathlib import Path

ARCHES = ("bamba",)


def write_tiny_hybrid(
    out_dir: str | Path,
    tokenizer,
    seed: int = 0,
    num_layers: int = 4,
    attn_layers: tuple[int, ...] = (1,),
    hidden: int = 64,
    chunk_size: int = 16,
) -> Path:
    """Layers `attn_layers` are attention, the others Mamba-2 (4 heads of 32, state 16, conv 4). A small
    `chunk_size` (the SSD scan's, mamba_chunk_size) makes short prompts cross chunks of the scan too.
    `tokenizer`: models.build_tokenizer's."""
    import torch
    from transformers import BambaConfig, BambaForCausalLM

    out = Path(out_dir)
    config = BambaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=num_layers,
        attn_layer_indices=list(attn_layers),
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=hidden * 2 // 4,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=chunk_size,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.25,  # decisive greedy choices (see models.write_tiny_model)
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = BambaForCausalLM(config).to(torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
