"""FP8 checkpoints (fms-model-optimizer's format, spyre_contract.architectures) of any family whose registry
record says `fp8`: the weights dequantized at load, so every backend computes with the checkpoint's values."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from spyre_runtime.config import ConfigError
from spyre_runtime.executor.loader import without_hf_adapters

log = logging.getLogger(__name__)


def load_fp8_model(model_dir: Path, tensor_parallel: bool, dtype: torch.dtype, overrides: dict):
    """An FP8 checkpoint (spyre_contract.architectures) with its weights dequantized to `dtype` at load:
    weight = float8 weight * weight_scale (per output channel [out, 1], or one per tensor), so every backend
    computes in `dtype` with the checkpoint's values; activations are not quantized (CPU backends have no FP8
    GEMM that helps here). Resident: the weights in `dtype`, as the memory plan counts them. `overrides`: the
    family's FMS overrides (rooms.py)."""
    from fms.models import get_model
    from fms.utils import serialization
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    del hf.quantization_config
    with without_hf_adapters():
        from fms.models.hf.config_utils import _FMS_MODEL_CONFIG_REGISTRY

        params = dict(_FMS_MODEL_CONFIG_REGISTRY.hf_config_to_fms_config_params(hf, None))
    architecture, variant = params.pop("architecture"), params.pop("variant")
    params.pop("model_path", None)
    kwargs = {"distributed_strategy": "tp", "group": torch.distributed.group.WORLD} if tensor_parallel else {}
    model = get_model(
        architecture,
        variant,
        device_type="cpu",
        data_type=dtype,
        **kwargs,
        **params,
        **overrides,
    )
    rank = torch.distributed.get_rank() if tensor_parallel else 0
    serialization.load_state_dict_into_model(
        model,
        dequantized_state_dict(model_dir, dtype),
        architecture,
        "hf",
        dtype=dtype,
        distributed_strategy="tp" if tensor_parallel else None,
        initial_device=torch.device("cpu"),
        rank=rank,
    )
    model.eval()
    log.info("FP8 checkpoint: weights dequantized to %s at load (weight * weight_scale)", dtype)
    return model


def dequantized_state_dict(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (HF names) with every FP8 `weight` times its `weight_scale`, in `dtype`;
    scales of activations (`input_scale`) dropped."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            for name in names:
                if name.endswith(("weight_scale", "input_scale")):
                    continue
                tensor = f.get_tensor(name)
                scale_name = name[: -len("weight")] + "weight_scale" if name.endswith("weight") else None
                if scale_name in names:
                    tensor = tensor.to(torch.float32) * f.get_tensor(scale_name).to(torch.float32)
                state[name] = tensor.to(dtype)
    if not state:
        raise ConfigError(f"model directory {model_dir} has no *.safetensors weights")
    return state
