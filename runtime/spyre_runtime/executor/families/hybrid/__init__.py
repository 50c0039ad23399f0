"""The hybrid (Mamba) room: `BambaForCausalLM` and Granite 4 "H" (GraniteMoeHybridForCausalLM with Mamba
layers), built of FMS `bamba` blocks (loader.py) whose Mamba layers run a mixer with per-sequence state
(mixer.py) in slots beside the paged KV cache (state.py). The config grammar is spyre_contract/hybrid.py.
Its hooks (families/__init__.py): `load_model`, `attach_state`."""

from __future__ import annotations

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.executor.families.hybrid.state import attach as attach_state
from spyre_runtime.executor.families.hybrid.state import load_if_hybrid

__all__ = ["attach_state", "load_model"]


def load_model(config: RuntimeConfig):
    """A hybrid model folder's model, loaded here (None for a model without Mamba layers)."""
    return load_if_hybrid(config, None)
