"""Granite 4 (GraniteMoeHybridForCausalLM). Dense (every layer attention): FMS's granite_moe_hybrid, given
the checkpoint's pad id (FMS 1.13.1 takes the 8b variant's, 100256, which must lie inside the vocabulary).
With Mamba layers (granite-4 "H"): the hybrid room loads it and holds its state."""

from __future__ import annotations

from spyre_runtime.executor.families.hybrid import attach_state, load_model

__all__ = ["attach_state", "fms_overrides", "load_model"]


def fms_overrides(hf_config: dict) -> dict:
    if hf_config.get("pad_token_id") is not None:
        return {"pad_id": int(hf_config["pad_token_id"])}
    return {}
