"""Pooling models (embedding models and cross-encoders): the model folder's kind, an FMS encoder compiled
for the static warm-up shapes, a scheduler that batches inputs of many requests into the smallest shape
that fits, and the engine thread that runs them.

    PoolingSpec   what the folder is: bert | roberta, embedding (pooling, normalize) or cross-encoder
    PoolingModel  FMS encoder + pooling (or classifier head), one compiled forward, every shape warmed
    PoolingScheduler.schedule() -> PoolingStep(shape, items)      (pure, tested without a model)
    PoolingEngine  thread: schedule -> PoolingModel.run -> deliver each item's vector

Shapes are `Shape(prompt_len, 0, batch_size)` (shared/DESIGN.md section 2, new tokens unused). Inputs are
right-padded to the shape's prompt length; rows beyond the batch are dummies (one token) and dropped.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from spyre_contract.architectures import ENCODER_MODEL_TYPES

from spyre_runtime.config import ConfigError, RuntimeConfig, Shape
from spyre_runtime.executor.compiler import compile_settings, compile_step
from spyre_runtime.executor.loader import resolve_dtype, without_hf_adapters
from spyre_runtime.executor.warmup import WarmupProgress

log = logging.getLogger(__name__)

POOLING_MODES = ("mean", "cls", "max", "last")
_FAMILIES = ENCODER_MODEL_TYPES  # the registry's encoders (spyre_contract.architectures)
_ST_POOLING_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "last",
}


# ---- what the model folder is ---------------------------------------------------------------------


@dataclass(frozen=True)
class PoolingSpec:
    """`is_cross_encoder`: a classifier head scores a pair of texts; otherwise an embedding model.
    `max_len`: tokens the model accepts (positions, and sentence-transformers' max_seq_length)."""

    architecture: str
    family: str  # bert | roberta
    is_cross_encoder: bool
    pooling: str = "cls"  # embedding models: mean | cls | max | last
    normalize: bool = True
    sigmoid: bool = True  # cross-encoders: sigmoid of the single logit (sentence-transformers' default)
    num_labels: int = 1
    max_len: int = 512
    hidden_size: int = 0

    @property
    def default_task(self) -> str:
        return "score" if self.is_cross_encoder else "embed"


def detect_task(model_dir: Path) -> str:
    """The task a folder serves when --task is not given: score for a classifier head on a bert/roberta
    encoder (a cross-encoder), embed for another encoder or a sentence-transformers folder, else generate."""
    cfg = _read_json(model_dir / "config.json")
    architecture = (cfg.get("architectures") or [""])[0]
    if cfg.get("model_type") in _FAMILIES:
        return "score" if architecture.endswith("ForSequenceClassification") else "embed"
    return "embed" if (model_dir / "modules.json").is_file() else "generate"


def detect_pooling(model_dir: Path, task: str | None = None) -> PoolingSpec:
    """Reads config.json and the sentence-transformers files (modules.json, 1_Pooling/config.json,
    sentence_bert_config.json). `task` (embed | score | rerank), when given, must suit the model."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model directory {model_dir}: cannot read config.json ({e})") from None
    architecture = (cfg.get("architectures") or ["?"])[0]
    family = _FAMILIES.get(cfg.get("model_type", ""))
    if family is None:
        raise ConfigError(
            f"{model_dir}: pooling models need a bert or roberta encoder (FMS); config.json has "
            f"model_type={cfg.get('model_type')!r}, architectures={cfg.get('architectures')}"
        )
    is_cross_encoder = architecture.endswith("ForSequenceClassification")
    max_len = int(cfg.get("max_position_embeddings", 512)) - (2 if family == "roberta" else 0)
    st_config = _read_json(model_dir / "sentence_bert_config.json")
    if st_config.get("max_seq_length"):
        max_len = min(max_len, int(st_config["max_seq_length"]))
    num_labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 1))
    common = {
        "architecture": architecture,
        "family": family,
        "max_len": max_len,
        "hidden_size": int(cfg.get("hidden_size", 0)),
        "num_labels": num_labels,
    }
    if is_cross_encoder:
        if task == "embed":
            raise ConfigError(
                f"--task=embed: {model_dir} is a cross-encoder ({architecture}); it serves score and rerank"
            )
        if num_labels != 1:
            raise ConfigError(
                f"{model_dir}: score and rerank need a cross-encoder with one label; it has {num_labels}"
            )
        st = cfg.get("sentence_transformers") or {}
        activation = str(st.get("activation_fn") or cfg.get("sbert_ce_default_activation_function") or "")
        return PoolingSpec(**common, is_cross_encoder=True, sigmoid="Identity" not in activation)
    pooling, normalize = _sentence_transformers_pooling(model_dir)
    return PoolingSpec(**common, is_cross_encoder=False, pooling=pooling, normalize=normalize)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read it ({e})") from None


def _sentence_transformers_pooling(model_dir: Path) -> tuple[str, bool]:
    """(pooling, normalize) from a sentence-transformers folder; CLS and normalized without one."""
    modules = _read_json(model_dir / "modules.json")
    if not modules:
        pooling_cfg = _read_json(model_dir / "1_Pooling" / "config.json")
        return (_pooling_mode(pooling_cfg, model_dir / "1_Pooling") if pooling_cfg else "cls"), True
    pooling, normalize = "cls", False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            path = model_dir / module.get("path", "1_Pooling")
            pooling = _pooling_mode(_read_json(path / "config.json"), path)
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ConfigError(
                f"{model_dir}/modules.json: module {kind} is not supported (only Pooling, Normalize)"
            )
    return pooling, normalize


def _pooling_mode(cfg: dict, where: Path) -> str:
    modes = [mode for key, mode in _ST_POOLING_KEYS.items() if cfg.get(key)]
    others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _ST_POOLING_KEYS]
    if len(modes) != 1 or others:
        raise ConfigError(
            f"{where}/config.json: exactly one of mean, cls, max or last-token pooling is supported; "
            f"it asks for {modes + others or 'none'}"
        )
    return modes[0]


# ---- the compiled model ---------------------------------------------------------------------------


def check_shapes(config: RuntimeConfig, spec: PoolingSpec) -> None:
    for shape in config.shapes:
        if shape.prompt_len > spec.max_len:
            raise ConfigError(
                f"SENDNN_INFERENCE_WARMUP_PROMPT_LENS: {shape.prompt_len} is longer than the "
                f"{spec.max_len} tokens {config.model_dir.name} accepts"
            )


def load_fms_encoder(model_dir: Path, spec: PoolingSpec, dtype: torch.dtype):
    """The FMS encoder (RoBERTaHeadless) or classifier (RoBERTaForClassification) with the folder's
    weights. FMS's hf_pretrained registry lacks bare encoders (BertModel, as sentence-transformers saves
    them), so the model is built from FMS's own HF parameter builders and weight adapters."""
    from fms.distributed.strategy import NoOpStrategy
    from fms.models.roberta import (
        RoBERTaClassificationConfig,
        RoBERTaConfig,
        RoBERTaForClassification,
        RoBERTaHeadless,
    )
    from fms.utils import serialization
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    with without_hf_adapters():
        from fms.models.hf.config_utils import param_builders
    builder = (
        param_builders.build_bert_params if spec.family == "bert" else param_builders.build_roberta_params
    )
    params = builder(hf_config, is_classify=spec.is_cross_encoder)
    params["p_dropout"] = 0.0
    if spec.is_cross_encoder:
        params.pop("tie_heads", None)  # no language-model head to tie (FMS warns otherwise)
    config_cls = RoBERTaClassificationConfig if spec.is_cross_encoder else RoBERTaConfig
    config = config_cls(**{k: v for k, v in params.items() if k in config_cls.__dataclass_fields__})
    prefix = f"{spec.family}."
    state = {
        (k if k.startswith(prefix) or not _is_encoder_key(k) else prefix + k): v
        for k, v in _weights(model_dir)
    }
    adapted = serialization.get_adapted(spec.family, "hf", state, {"model_config": config})
    if spec.is_cross_encoder:
        model = RoBERTaForClassification(config, NoOpStrategy)
        wanted = adapted
    else:
        model = RoBERTaHeadless(config, NoOpStrategy)
        wanted = {k.removeprefix("base_model."): v for k, v in adapted.items() if k.startswith("base_model.")}
    missing, _ = model.load_state_dict(wanted, strict=False)
    if missing:
        raise ConfigError(
            f"{model_dir}: the weights lack {len(missing)} tensors of the model, e.g. {missing[:3]}"
        )
    return model.to(dtype).eval()


def load_pooling_model(config: RuntimeConfig, compile_only: bool = False) -> PoolingModel:
    """The folder's pooling model, padded with its tokenizer's pad token (a compile Job's entry point)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    spec = detect_pooling(config.model_dir, config.task)
    return PoolingModel(config, spec, pad_id, compile_only=compile_only)


def _is_encoder_key(key: str) -> bool:
    return key.startswith(("embeddings.", "encoder.", "pooler."))


def _weights(model_dir: Path):
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        for f in files:
            yield from load_file(f).items()
        return
    bin_file = model_dir / "pytorch_model.bin"
    if not bin_file.is_file():
        raise ConfigError(f"{model_dir}: no *.safetensors or pytorch_model.bin weights")
    yield from torch.load(bin_file, map_location="cpu", weights_only=True).items()


@dataclass(frozen=True)
class EncoderBatch:
    """Fixed-shape inputs of one step. ids, type_ids: [B, L] long; key_mask: [B, L] bool (True: a real
    token). Rows past `num_rows` are dummies."""

    ids: torch.Tensor
    type_ids: torch.Tensor
    key_mask: torch.Tensor
    num_rows: int


class PoolingModel:
    """One compiled forward for every warm-up shape; after warm-up a shape that would compile raises."""

    def __init__(
        self, config: RuntimeConfig, spec: PoolingSpec, pad_id: int, model=None, compile_only: bool = False
    ) -> None:
        """`compile_only`: a precompile Job's model (sendnn's card-less backend), see graph_cache.py."""
        self.config = config
        self.spec = spec
        self.pad_id = pad_id
        self.dtype = resolve_dtype(config.dtype, config.backend, config.model_dir)
        check_shapes(config, spec)
        self.model = model if model is not None else load_fms_encoder(config.model_dir, spec, self.dtype)
        self._step_fn = compile_step(self._forward, config.backend, compile_only)
        self.is_warm = False
        self.shape_seconds: dict[Shape, float] = {}
        self.progress = WarmupProgress()  # shapes warmed so far, for the log, /health and a gauge

    def set_env(self, values: dict[str, str]) -> None:
        """Environment for the compiler (graph_cache.warmup_with_cache's private inductor directory)."""
        os.environ.update(values)

    def close(self) -> None:
        pass

    def _forward(self, ids: torch.Tensor, type_ids: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """[B, L] x3 -> [B, D] embeddings (pooled, normalized as the folder says) or [B] scores."""
        batch, length = ids.shape
        mask = key_mask[:, None, :].expand(batch, length, length)  # [B, Lq, Lk]
        kwargs = {"token_type_ids": type_ids, "mask": mask, "attn_name": "sdpa_bidirectional"}
        if self.spec.is_cross_encoder:
            logits = self.model(ids, **kwargs).float()[:, 0]
            return torch.sigmoid(logits) if self.spec.sigmoid else logits
        hidden = self.model(ids, **kwargs).float()  # [B, L, D]
        keep = key_mask.unsqueeze(-1)
        if self.spec.pooling == "mean":
            pooled = (hidden * keep).sum(1) / keep.sum(1).clamp(min=1)
        elif self.spec.pooling == "max":
            pooled = hidden.masked_fill(~keep, float("-inf")).max(1).values
        elif self.spec.pooling == "last":
            last = (key_mask.sum(1) - 1).clamp(min=0)
            pooled = hidden[torch.arange(batch), last]
        else:
            pooled = hidden[:, 0]
        return torch.nn.functional.normalize(pooled, dim=-1) if self.spec.normalize else pooled

    def inputs(self, shape: Shape, rows: list[tuple[list[int], list[int] | None]]) -> EncoderBatch:
        """rows: (token ids, token type ids or None) of at most shape.batch_size inputs of at most
        shape.prompt_len tokens, right-padded; dummy rows hold one pad token (no all-masked rows: NaN)."""
        ids = torch.full((shape.batch_size, shape.prompt_len), self.pad_id, dtype=torch.long)
        type_ids = torch.zeros_like(ids)
        key_mask = torch.zeros((shape.batch_size, shape.prompt_len), dtype=torch.bool)
        key_mask[:, 0] = True
        for row, (tokens, types) in enumerate(rows):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            if types is not None:
                type_ids[row, : len(types)] = torch.tensor(types, dtype=torch.long)
            key_mask[row, : len(tokens)] = True
        return EncoderBatch(ids, type_ids, key_mask, len(rows))

    def run(self, shape: Shape, rows: list[tuple[list[int], list[int] | None]]) -> torch.Tensor:
        """-> [len(rows), D] or [len(rows)] float32."""
        batch = self.inputs(shape, rows)
        with torch.inference_mode():
            if self.is_warm and self.config.backend != "eager":
                with torch.compiler.set_stance("fail_on_recompile"):
                    out = self._step_fn(batch.ids, batch.type_ids, batch.key_mask)
            else:
                with compile_settings(self.config.backend, self.config.cache_enabled):
                    out = self._step_fn(batch.ids, batch.type_ids, batch.key_mask)
        return out[: batch.num_rows]

    def warmup(self) -> float:
        """Compiles and runs every shape once."""
        t_all = time.monotonic()
        graphs = len(self.config.shapes)
        self.progress.start(graphs)
        with torch._dynamo.config.patch(
            recompile_limit=max(8, graphs + 2), accumulated_recompile_limit=max(256, graphs * 2)
        ):
            for shape in self.config.shapes:
                t0 = time.monotonic()
                self.run(shape, [([self.pad_id] * shape.prompt_len, None)] * shape.batch_size)
                self.shape_seconds[shape] = time.monotonic() - t0
                what = f"prompt_len:{shape.prompt_len} batch_size:{shape.batch_size}"
                self.progress.step("Pool", what, self.shape_seconds[shape])
        self.is_warm = True
        seconds = time.monotonic() - t_all
        log.info("Warmup finished in %.2f s", seconds)
        return seconds


def shape_str(shape: Shape) -> str:
    return f"(prompt_len={shape.prompt_len}, batch_size={shape.batch_size})"


def shapes_str(shapes) -> str:
    return ", ".join(shape_str(s) for s in shapes)
