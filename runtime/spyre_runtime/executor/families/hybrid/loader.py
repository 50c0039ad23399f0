"""Loading a hybrid (Mamba) model as FMS's `bamba` (Mamba-2 blocks and attention blocks of FMS's modules).

- `BambaForCausalLM`: FMS's own HF loading, given what its 1.13.1 config mapping drops: `attn_layer_indices`
  (without it every layer is built as Mamba and the attention weights go unused), the MLP's exact width and
  the rope theta.
- `GraniteMoeHybridForCausalLM` with Mamba layers (granite-4 "H", dense: no experts, no position embedding):
  FMS 1.13.1's `granite_moe_hybrid` builds the dense form only, so the same `bamba` blocks are built and the
  HF weights mapped onto them here. Granite's multipliers are folded into weights: the embedding times
  `embedding_multiplier`, the head over `logits_scaling`, each block's last linear (out_proj or the
  attention's dense, and the MLP's w2) times `residual_multiplier` (residual + m * f(x));
  `attention_multiplier` is the attention's scale and the attention has no position encoder
  (`position_embedding_type` none).
"""

from __future__ import annotations

import json
import re

import torch
from spyre_contract.hybrid import HybridSpec

from spyre_runtime.config import ConfigError, RuntimeConfig
from spyre_runtime.executor.graph_cache import loading
from spyre_runtime.executor.loader import without_hf_adapters


def load_hybrid_model(config: RuntimeConfig, spec: HybridSpec, dtype: torch.dtype) -> torch.nn.Module:
    hf = json.loads((config.model_dir / "config.json").read_text())
    with loading(config):
        if spec.family == "granitemoehybrid":
            model = load_granite_hybrid(config, spec, hf)
        else:
            model = load_bamba(config, spec, hf, dtype)
    return model.to(dtype).eval()


def load_bamba(config: RuntimeConfig, spec: HybridSpec, hf: dict, dtype: torch.dtype) -> torch.nn.Module:
    from fms.models import get_model

    rope = hf.get("rope_parameters") or {}
    with without_hf_adapters():
        return get_model(
            "hf_pretrained",
            model_path=str(config.model_dir),
            device_type="cpu",
            data_type=dtype,
            attn_layer_indices=list(spec.attn_layers),
            multiple_of=1,
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        )


def check_granite_hybrid(hf: dict, spec: HybridSpec) -> None:
    """The granite-4 "H" forms this loader builds, else one line."""
    arch = "GraniteMoeHybridForCausalLM with Mamba layers"
    if hf.get("position_embedding_type") not in (None, "nope"):
        raise ConfigError(
            f"{arch}: position_embedding_type={hf['position_embedding_type']!r} is not supported"
        )
    if spec.groups != 1:
        raise ConfigError(
            f"{arch}: mamba_n_groups={spec.groups} is not supported (1 only: an ungrouped norm)"
        )
    if hf.get("attention_bias") or hf.get("mamba_proj_bias"):
        raise ConfigError(f"{arch}: attention_bias and mamba_proj_bias must be false")


def load_granite_hybrid(config: RuntimeConfig, spec: HybridSpec, hf: dict) -> torch.nn.Module:
    from fms.models.bamba import Bamba, BambaConfig
    from safetensors.torch import load_file

    check_granite_hybrid(hf, spec)
    hidden = int(hf["hidden_size"])
    fms_config = BambaConfig(
        src_vocab_size=int(hf["vocab_size"]),
        emb_dim=hidden,
        nheads=int(hf["num_attention_heads"]),
        kvheads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        nlayers=spec.num_layers,
        attn_layer_indices=list(spec.attn_layers),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        activation_fn=hf.get("hidden_act", "silu"),
        hidden_grow_factor=int(hf["shared_intermediate_size"]) / hidden,
        multiple_of=1,
        mamba_n_heads=spec.heads,
        head_dim=spec.head_dim,
        state_size=spec.state_size,
        conv_kernel=spec.conv_kernel,
        mamba_expand=spec.intermediate / hidden,
        n_groups=spec.groups,
        chunk_size=spec.chunk_size,
        use_bias=False,
        use_conv_bias=bool(hf.get("mamba_conv_bias", True)),
        tie_heads=False,
        fused_weights=False,
        max_expected_seq_len=int(hf.get("max_position_embeddings", 4096)),
    )
    model = Bamba(fms_config)
    hf_weights = {}
    for path in sorted(config.model_dir.glob("*.safetensors")):
        hf_weights |= load_file(str(path))
    model.load_state_dict(granite_hybrid_weights(hf_weights, hf), strict=True)
    for block in model.base_model.layers:
        if not block.is_mamba_layer:
            block.attn.scale_factor = float(hf.get("attention_multiplier", 1.0))
            block.attn.position_encoder = None
    return model


_NAMES = [
    (r"^model\.embed_tokens\.", "base_model.embedding."),
    (r"^lm_head\.", "head."),
    (r"^model\.norm\.", "base_model.dec_norm."),
    (r"^model\.layers\.", "base_model.layers."),
    (r"\.mamba\.", ".ssm."),
    (r"\.self_attn\.q_proj\.", ".attn.in_proj.query."),
    (r"\.self_attn\.k_proj\.", ".attn.in_proj.key."),
    (r"\.self_attn\.v_proj\.", ".attn.in_proj.value."),
    (r"\.self_attn\.o_proj\.", ".attn.dense."),
    (r"\.shared_mlp\.output_linear\.", ".ff_sub_layer.w2."),
    (r"\.input_layernorm\.", ".ln."),
    (r"\.post_attention_layernorm\.", ".ff_ln."),
]


def granite_hybrid_weights(hf_weights: dict[str, torch.Tensor], hf: dict) -> dict[str, torch.Tensor]:
    """HF GraniteMoeHybrid names -> FMS bamba names, with Granite's multipliers folded in (module doc)."""
    residual = float(hf.get("residual_multiplier", 1.0))
    out = {}
    for name, weight in hf_weights.items():
        for pattern, repl in _NAMES:
            name = re.sub(pattern, repl, name)
        if ".shared_mlp.input_linear." in name:  # [gate; up] -> wg, w1
            gate, up = weight.chunk(2, dim=0)
            out[name.replace("shared_mlp.input_linear", "ff_sub_layer.wg")] = gate
            out[name.replace("shared_mlp.input_linear", "ff_sub_layer.w1")] = up
            continue
        if name.endswith(("ssm.out_proj.weight", "attn.dense.weight", "ff_sub_layer.w2.weight")):
            weight = weight * residual
        out[name] = weight
    embedding = out["base_model.embedding.weight"]
    head = out.get("head.weight", embedding)  # tied: the embedding
    out["head.weight"] = head / float(hf.get("logits_scaling", 1.0))
    out["base_model.embedding.weight"] = embedding * float(hf.get("embedding_multiplier", 1.0))
    return out
