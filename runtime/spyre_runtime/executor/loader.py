"""Loading: the process's thread pool, the decoder's dtype, its weights (this rank's shard under tensor
parallelism, in a load slot), and what is done to them once before anything compiles: the linear weights
packed for oneDNN and the rotary-frequency cache filled."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from spyre_contract.architectures import is_fp8

from spyre_runtime.config import ConfigError, RuntimeConfig
from spyre_runtime.executor import linear
from spyre_runtime.executor.graph_cache import loading

log = logging.getLogger(__name__)


def cgroup_cpu_limit() -> int | None:
    """CPUs allowed by the cgroup v2 (cpu.max) or v1 (cfs quota) limit, or None when unlimited."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            return max(1, int(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        if quota > 0:
            return max(1, quota // period)
    except (OSError, ValueError):
        pass
    return None


def configure_threads(config: RuntimeConfig) -> int:
    """Sizes torch's thread pool from SENDNN_INFERENCE_NUM_CPUS, else the cgroup quota, else the CPU count."""
    if not config.update_thread_config:
        return torch.get_num_threads()
    cpus = config.num_cpus or cgroup_cpu_limit() or len(os.sched_getaffinity(0))
    threads = max(1, cpus // config.tensor_parallel_size)
    torch.set_num_threads(threads)
    return threads


@dataclass(frozen=True)
class ModelDims:
    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int


def model_dims(model) -> ModelDims:
    from fms.modules.attention import MultiHeadAttention

    attns = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if not attns:
        raise ValueError("the model has no FMS MultiHeadAttention layers")
    first = attns[0]
    vocab = getattr(model.config, "src_vocab_size", None)
    return ModelDims(len(attns), first.nheads, first.kvheads, first.emb_kq_per_head, vocab)


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, backend: str, model_dir: Path) -> torch.dtype:
    """--dtype to a torch dtype. `auto`: float16 for sendnn (what Spyre cards run), else the checkpoint's
    dtype from config.json (`dtype` or `torch_dtype`), float32 when it names none or an unknown one."""
    if dtype != "auto":
        return TORCH_DTYPES[dtype]
    if backend == "sendnn":
        return torch.float16
    try:
        hf = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return torch.float32
    return TORCH_DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype")), torch.float32)


def load_fms_model(model_dir: Path, tensor_parallel: bool = False, dtype: torch.dtype = torch.float32):
    """The whole model, or with `tensor_parallel` this rank's shard (FMS's "tp" strategy over the default
    process group, which must already be initialized). An FP8 checkpoint is dequantized (load_fp8_model)."""
    from fms.models import get_model

    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model directory {model_dir} has no config.json")
    hf_config = json.loads((model_dir / "config.json").read_text())
    if is_fp8(hf_config):
        return load_fp8_model(model_dir, hf_config, tensor_parallel, dtype)
    kwargs = {"distributed_strategy": "tp", "group": torch.distributed.group.WORLD} if tensor_parallel else {}
    model = get_model(
        "hf_pretrained",
        model_path=str(model_dir),
        device_type="cpu",
        data_type=dtype,
        **kwargs,
        **fms_overrides(hf_config),
    )
    model.eval()
    return model


def fms_overrides(hf_config: dict) -> dict:
    """What FMS 1.13.1's param builders do not read from config.json, given explicitly: Qwen3's rope theta
    (its builder passes `rope_base`, which Qwen3Config ignores, so 1e6 always) and Granite 4's pad id (taken
    from the 8b variant, 100256, which must lie inside the vocabulary)."""
    arch = (hf_config.get("architectures") or [""])[0]
    if arch == "Qwen3ForCausalLM":
        rope = hf_config.get("rope_parameters") or {}
        theta = rope.get("rope_theta", hf_config.get("rope_theta"))
        return {"rope_theta": float(theta)} if theta else {}
    if arch == "GraniteMoeHybridForCausalLM" and hf_config.get("pad_token_id") is not None:
        return {"pad_id": int(hf_config["pad_token_id"])}
    return {}


def load_fp8_model(model_dir: Path, hf_config: dict, tensor_parallel: bool, dtype: torch.dtype):
    """An FP8 checkpoint (spyre_contract.architectures) with its weights dequantized to `dtype` at load:
    weight = float8 weight * weight_scale (per output channel [out, 1], or one per tensor), so every backend
    computes in `dtype` with the checkpoint's values; activations are not quantized (CPU backends have no FP8
    GEMM that helps here). Resident: the weights in `dtype`, as the memory plan counts them."""
    from fms.models import get_model
    from fms.models.hf.config_utils import _FMS_MODEL_CONFIG_REGISTRY
    from fms.utils import serialization
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    del hf.quantization_config
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
        **fms_overrides(hf_config),
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


def load_model(config: RuntimeConfig, model=None) -> tuple[torch.nn.Module, torch.dtype]:
    """The decoder and its dtype: loaded in a load slot (see graph_cache.loading), only this rank's shard
    with --tensor-parallel-size N > 1; or `model` as given (tests), in its own dtype."""
    if model is not None:
        return model, next(model.parameters()).dtype
    dtype = resolve_dtype(config.dtype, config.backend, config.model_dir)
    with loading(config):
        model = load_fms_model(config.model_dir, tensor_parallel=config.tensor_parallel_size > 1, dtype=dtype)
    return model, dtype


def pack_weights(model: torch.nn.Module, config: RuntimeConfig, dtype: torch.dtype) -> bool:
    """Every step runs its GEMMs on weights prepacked for oneDNN, tuned for the largest decode batch
    (linear.py); one more copy of the linear weights in memory. False where they cannot be packed."""
    rows = max(config.batch_buckets) if config.use_cb else max(s.batch_size for s in config.shapes)
    packed = linear.can_pack(dtype, config.backend)
    if packed:
        n = linear.pack_linears(model, rows)
        log.info("linear layers: %d run on weights prepacked for oneDNN (tuned for %d rows)", n, rows)
    return packed


def prime_rotary(model: torch.nn.Module, max_len: int) -> None:
    """Fills FMS's rotary-frequency cache before compiling, so tracing never mutates it."""
    from fms.modules.positions import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.compute_freqs_cis(torch.device("cpu"), max(max_len, 2048))
