"""The runtime side of the family registry: the registry's record of a model folder's architecture
(spyre_contract.architectures) and its room (a module of this package, imported by name when the record
names one, as vLLM's model registry does), with the room's hooks called where the executor needs them
(families/__init__.py); a family without a room, or a room without a hook, runs as a plain FMS decoder."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from spyre_contract.architectures import Architecture, architecture_of, is_fp8, lookup

from spyre_runtime.config import ConfigError, RuntimeConfig
from spyre_runtime.executor.families.fp8 import load_fp8_model
from spyre_runtime.executor.graph_cache import loading
from spyre_runtime.executor.loader import resolve_dtype, without_hf_adapters


@dataclass(frozen=True)
class Family:
    architecture: str  # "" when config.json names none (test models built in memory)
    record: Architecture | None
    room: ModuleType | None

    def hook(self, name: str):
        return getattr(self.room, name, None)

    def fms_overrides(self, hf_config: dict) -> dict:
        """What FMS 1.13.1's param builders do not read from config.json, given explicitly."""
        hook = self.hook("fms_overrides")
        return hook(hf_config) if hook else {}

    def load_model(self, config: RuntimeConfig):
        """The model when its family loads it itself (a hybrid one), else None."""
        hook = self.hook("load_model")
        return hook(config) if hook else None

    def split_model(self, model: torch.nn.Module, tensor_parallel_size: int):
        """(the model the executor compiles, an image-text model's vision encoder or None)."""
        hook = self.hook("split_model")
        return hook(model, tensor_parallel_size) if hook else (model, None)

    def attach_state(self, model: torch.nn.Module, config: RuntimeConfig, dtype: torch.dtype):
        """The family's per-sequence state beside the KV cache (a hybrid model's Mamba slots), or None."""
        hook = self.hook("attach_state")
        return hook(model, config, dtype) if hook else None


def room(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.{name}")


def family_of_config(hf_config: dict) -> Family:
    record = lookup(hf_config)
    return Family(architecture_of(hf_config), record, room(record.room) if record and record.room else None)


def family_of(model_dir: Path) -> Family:
    """The family of a model folder (a folder without a readable config.json: no record, no room)."""
    try:
        hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        hf_config = {}
    return family_of_config(hf_config)


def load_model(config: RuntimeConfig, model=None) -> tuple[torch.nn.Module, torch.dtype]:
    """The decoder and its dtype: `model` as given (tests), in its own dtype; else loaded by its family, in a
    load slot (see graph_cache.loading), only this rank's shard with --tensor-parallel-size N > 1."""
    if model is None:
        model = family_of(config.model_dir).load_model(config)
    if model is not None:
        return model, next(model.parameters()).dtype
    dtype = resolve_dtype(config.dtype, config.backend, config.model_dir)
    with loading(config):
        model = load_fms_model(config.model_dir, tensor_parallel=config.tensor_parallel_size > 1, dtype=dtype)
    return model, dtype


def load_fms_model(model_dir: Path, tensor_parallel: bool = False, dtype: torch.dtype = torch.float32):
    """The whole model, or with `tensor_parallel` this rank's shard (FMS's "tp" strategy over the default
    process group, which must already be initialized), with its family's FMS overrides. An FP8 checkpoint
    is dequantized (fp8.py)."""
    from fms.models import get_model

    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model directory {model_dir} has no config.json")
    hf_config = json.loads((model_dir / "config.json").read_text())
    overrides = family_of_config(hf_config).fms_overrides(hf_config)
    if is_fp8(hf_config):
        return load_fp8_model(model_dir, tensor_parallel, dtype, overrides)
    kwargs = {"distributed_strategy": "tp", "group": torch.distributed.group.WORLD} if tensor_parallel else {}
    with without_hf_adapters():
        model = get_model(
            "hf_pretrained",
            model_path=str(model_dir),
            device_type="cpu",
            data_type=dtype,
            **kwargs,
            **overrides,
        )
    model.eval()
    return model
