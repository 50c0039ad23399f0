"""A hybrid (Mamba) decoder's shape, read from its config.json: which layers are Mamba-2 layers, and what one
sequence's state holds in each (the conv window and the SSM state). Pure (no torch): the runtime's settings
(prefix caching off, the memory plan) and its hybrid room (runtime/spyre_runtime/executor/families/hybrid/)
read it; the architectures with Mamba layers are the registry's `hybrid_state` ones (architectures.py).

Hybrid models: `BambaForCausalLM` (FMS's `bamba`: Mamba-2 layers beside attention layers,
`attn_layer_indices`) and `GraniteMoeHybridForCausalLM` with Mamba layers in `layer_types` (granite-4 "H";
"mamba" in hub configs, "linear_attention" in transformers 5's), built as FMS `bamba` blocks
(executor/families/hybrid/loader.py). A GraniteMoeHybridForCausalLM whose layers are all attention is the
dense Granite 4, not hybrid."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from spyre_contract.architectures import ARCHITECTURES, lookup

HYBRID_ARCHITECTURES = tuple(name for name, arch in ARCHITECTURES.items() if arch.hybrid_state)
MAMBA_LAYER_TYPES = ("mamba", "linear_attention")


class HybridModelError(ValueError):
    """A hybrid model this runtime cannot serve (one line, at start-up)."""


@dataclass(frozen=True)
class HybridSpec:
    family: str  # "bamba" | "granitemoehybrid"
    num_layers: int
    attn_layers: tuple[int, ...]
    heads: int  # Mamba heads
    head_dim: int
    state_size: int
    groups: int
    conv_kernel: int
    intermediate: int  # expand * hidden
    chunk_size: int  # the SSD scan's chunk (mamba_chunk_size)

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.attn_layers)

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.groups * self.state_size

    def state_elements(self) -> int:
        """Elements of one sequence's state over every Mamba layer (conv window + SSM state)."""
        per_layer = self.conv_dim * self.conv_kernel + self.heads * self.head_dim * self.state_size
        return len(self.mamba_layers) * per_layer

    def state_bytes(self, num_slots: int, dtype_bytes: int) -> int:
        return num_slots * self.state_elements() * dtype_bytes

    @classmethod
    def from_config(cls, config: dict) -> HybridSpec | None:
        """None for a model without Mamba layers; HybridModelError for a hybrid one we cannot serve."""
        record = lookup(config)
        if record is None or not record.hybrid_state:
            return None
        arch = (config.get("architectures") or [""])[0]
        kinds = config.get("layer_types") or []
        if arch == "GraniteMoeHybridForCausalLM" and any(k in MAMBA_LAYER_TYPES for k in kinds):
            family, attn = "granitemoehybrid", [i for i, k in enumerate(kinds) if k not in MAMBA_LAYER_TYPES]
        elif arch == "BambaForCausalLM":
            family, attn = "bamba", config.get("attn_layer_indices") or []
        else:
            return None
        try:
            hidden = int(config["hidden_size"])
            spec = cls(
                family=family,
                num_layers=int(config["num_hidden_layers"]),
                attn_layers=tuple(int(i) for i in attn),
                heads=int(config["mamba_n_heads"]),
                head_dim=int(config["mamba_d_head"]) if config.get("mamba_d_head") != "auto" else 0,
                state_size=int(config["mamba_d_state"]),
                groups=int(config.get("mamba_n_groups", 1)),
                conv_kernel=int(config.get("mamba_d_conv", 4)),
                intermediate=int(float(config.get("mamba_expand", 2)) * hidden),
                chunk_size=int(config.get("mamba_chunk_size", 256)),
            )
            if not spec.head_dim:  # "auto"
                spec = dataclasses.replace(spec, head_dim=spec.intermediate // spec.heads)
        except (KeyError, TypeError, ValueError) as e:
            raise HybridModelError(f"config.json of a hybrid model lacks a Mamba setting ({e})") from None
        if config.get("hidden_act", "silu") not in ("silu", "swish"):
            raise HybridModelError(f"hidden_act={config.get('hidden_act')!r}: the Mamba layers run silu only")
        if spec.heads * spec.head_dim != spec.intermediate or spec.heads % spec.groups:
            raise HybridModelError(
                f"mamba_n_heads * mamba_d_head ({spec.heads * spec.head_dim}) must equal mamba_expand * "
                f"hidden_size ({spec.intermediate}), and the heads divide into mamba_n_groups"
            )
        return spec

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> HybridSpec | None:
        path = Path(model_dir) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return cls.from_config(config)
