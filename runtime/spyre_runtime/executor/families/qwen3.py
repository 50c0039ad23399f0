"""Qwen3 (FMS's qwen3): its rope theta, which FMS 1.13.1's param builder passes as `rope_base` (ignored by
Qwen3Config, so 1e6 always), is given explicitly."""

from __future__ import annotations


def fms_overrides(hf_config: dict) -> dict:
    rope = hf_config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf_config.get("rope_theta"))
    return {"rope_theta": float(theta)} if theta else {}
