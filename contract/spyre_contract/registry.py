"""The known-configurations registry: model configurations known to fit the cards, per platform.

A YAML file (built-in `known_configs.yaml`, or `SENDNN_INFERENCE_MODEL_CONFIG_FILE`) lists models, each
matched by the `architectures[0]` of its config.json (and optionally more config.json keys, `match`; a
dotted key reads a nested value, e.g. `quantization_config.format`, and `null` matches an absent one),
with configurations per platform (x86_64, ppc64le, s390x):

- decoders (`task: generate`): `{tensor_parallel_size, max_model_len, max_num_seqs}`; a requested
  configuration is known when one entry has the same tensor-parallel size and limits at least as large;
- pooling models (`task: embed | score`): `{tensor_parallel_size, warmup_shapes: [[prompt_len,
  batch_size], ...]}`; known when every requested shape is one of the entry's shapes;
- any configuration may carry `env`: variables the pod gets unless already set (never contract variables,
  which are read before the registry is consulted).

`check_known_config` is the one entry point: the runtime calls it at start-up, the operator before it
creates pods. With `SENDNN_INFERENCE_REQUIRE_KNOWN_CONFIG=1` an unknown configuration is an error (one line
naming the model and the nearest known configuration); otherwise it is a warning. Pure: no torch, no I/O
but reading the YAML file."""

from __future__ import annotations

import math
import platform as _platform
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from importlib.resources import files
from pathlib import Path

import yaml

from spyre_contract.environment import ALIAS_PREFIX, ENV_PREFIX, ContractError, Env, Shape

PLATFORMS = ("x86_64", "ppc64le", "s390x")
REGISTRY_TASKS = ("generate", "embed", "score")
BUILTIN = "built-in known_configs.yaml"
_PLATFORM_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "ppc64el": "ppc64le"}


def current_platform() -> str:
    machine = _platform.machine().lower()
    return _PLATFORM_ALIASES.get(machine, machine)


def is_pooling(task: str) -> bool:
    return task != "generate"


@dataclass(frozen=True)
class KnownConfig:
    """One configuration known to fit. Decoders use the limits, pooling models the warm-up shapes."""

    tensor_parallel_size: int = 1
    max_model_len: int = 0
    max_num_seqs: int = 0
    warmup_shapes: tuple[tuple[int, int], ...] = ()  # (prompt_len, batch_size)
    env: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        if self.warmup_shapes:
            shapes = ", ".join(f"[{p}, {b}]" for p, b in self.warmup_shapes)
            return f"tensor_parallel_size={self.tensor_parallel_size}, warmup_shapes=[{shapes}]"
        return (
            f"tensor_parallel_size={self.tensor_parallel_size}, max_model_len={self.max_model_len}, "
            f"max_num_seqs={self.max_num_seqs}"
        )


@dataclass(frozen=True)
class KnownModel:
    name: str
    architecture: str
    task: str
    match: tuple[tuple[str, object], ...] = ()
    platforms: tuple[tuple[str, tuple[KnownConfig, ...]], ...] = ()

    def configs(self, platform: str) -> tuple[KnownConfig, ...]:
        return dict(self.platforms).get(platform, ())

    def matches(self, architecture: str, model_config: Mapping | None) -> bool:
        if architecture != self.architecture:
            return False
        if model_config is None:  # the architecture is all the caller knows
            return True
        return all(config_value(model_config, key) == value for key, value in self.match)


def config_value(model_config: Mapping, key: str):
    """config.json's value at `key`; a dotted key reads nested mappings (`quantization_config.format`,
    `text_config.hidden_size`). None where any part is missing, so `key: null` matches its absence."""
    value = model_config
    for part in key.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


@dataclass(frozen=True)
class Registry:
    source: str
    models: tuple[KnownModel, ...]


@dataclass(frozen=True)
class RequestedConfig:
    """What a pod would run. `shapes`: pooling (prompt_len, batch_size) pairs."""

    architecture: str
    task: str = "generate"
    tensor_parallel_size: int = 1
    max_model_len: int = 0
    max_num_seqs: int = 0
    shapes: tuple[tuple[int, int], ...] = ()
    platform: str = field(default_factory=current_platform)
    model_config: Mapping | None = None
    model_name: str = ""

    def describe(self) -> str:
        if is_pooling(self.task):
            shapes = ", ".join(f"[{p}, {b}]" for p, b in self.shapes)
            return f"tensor_parallel_size={self.tensor_parallel_size}, warmup_shapes=[{shapes}]"
        return (
            f"tensor_parallel_size={self.tensor_parallel_size}, max_model_len={self.max_model_len}, "
            f"max_num_seqs={self.max_num_seqs}"
        )


@dataclass(frozen=True)
class Verdict:
    """`config` is the matching configuration, or the nearest known one (None when there is none)."""

    is_known: bool
    message: str
    model: KnownModel | None = None
    config: KnownConfig | None = None

    @property
    def env(self) -> dict[str, str]:
        return dict(self.config.env) if self.is_known and self.config else {}


# ---- reading the YAML ----------------------------------------------------------------------------


def registry_settings(environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """(SENDNN_INFERENCE_REQUIRE_KNOWN_CONFIG, SENDNN_INFERENCE_MODEL_CONFIG_FILE or "" for built-in)."""
    env = Env(environ)
    return env.bool("REQUIRE_KNOWN_CONFIG", False), env.str("MODEL_CONFIG_FILE", "")


def load_registry(path: str | Path | None = None) -> Registry:
    """The built-in registry, or the file at `path`, which replaces it. Bad files raise ContractError."""
    if not path:
        return _builtin()
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ContractError(f"{ENV_PREFIX}MODEL_CONFIG_FILE={str(path)!r}: cannot read it ({e})") from None
    return parse_registry(text, f"{ENV_PREFIX}MODEL_CONFIG_FILE={path}")


@lru_cache(maxsize=1)
def _builtin() -> Registry:
    return parse_registry(files("spyre_contract").joinpath("known_configs.yaml").read_text(), BUILTIN)


def parse_registry(text: str, source: str) -> Registry:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ContractError(f"{source}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), list):
        raise ContractError(f"{source}: expected a mapping with a 'models' list")
    models = tuple(_model(entry, f"{source}: models[{i}]") for i, entry in enumerate(doc["models"]))
    return Registry(source, models)


def _model(entry, where: str) -> KnownModel:
    if not isinstance(entry, dict):
        raise ContractError(f"{where}: expected a mapping")
    unknown = set(entry) - {"name", "architecture", "task", "match", "platforms"}
    if unknown:
        raise ContractError(f"{where}: unknown keys {sorted(unknown)}")
    for key in ("name", "architecture"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise ContractError(f"{where}: '{key}' must be a non-empty string")
    where = f"{where} ({entry['name']})"
    task = entry.get("task", "generate")
    if task not in REGISTRY_TASKS:
        raise ContractError(f"{where}: task {task!r} is not one of {', '.join(REGISTRY_TASKS)}")
    match = entry.get("match") or {}
    if not isinstance(match, dict):
        raise ContractError(f"{where}: 'match' must be a mapping of config.json keys to values")
    platforms = entry.get("platforms")
    if not isinstance(platforms, dict) or not platforms:
        raise ContractError(f"{where}: 'platforms' must map {', '.join(PLATFORMS)} to configuration lists")
    parsed = []
    for name, configs in platforms.items():
        if name not in PLATFORMS:
            raise ContractError(f"{where}: platform {name!r} is not one of {', '.join(PLATFORMS)}")
        if not isinstance(configs, list):
            raise ContractError(f"{where}: platforms.{name} must be a list")
        parsed.append(
            (name, tuple(_config(c, task, f"{where}: platforms.{name}[{i}]") for i, c in enumerate(configs)))
        )
    return KnownModel(entry["name"], entry["architecture"], task, tuple(sorted(match.items())), tuple(parsed))


def _config(entry, task: str, where: str) -> KnownConfig:
    if not isinstance(entry, dict):
        raise ContractError(f"{where}: expected a mapping")
    allowed = {"tensor_parallel_size", "env"} | (
        {"warmup_shapes"} if is_pooling(task) else {"max_model_len", "max_num_seqs"}
    )
    unknown = set(entry) - allowed
    if unknown:
        raise ContractError(f"{where}: unknown keys {sorted(unknown)} for task {task}")

    def positive(key: str, default: int | None = None) -> int:
        value = entry.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ContractError(f"{where}: '{key}' must be a positive integer")
        return value

    tp = positive("tensor_parallel_size", 1)
    env = entry.get("env") or {}
    if not isinstance(env, dict):
        raise ContractError(f"{where}: 'env' must be a mapping")
    for key in env:
        if not isinstance(key, str) or key.startswith((ENV_PREFIX, ALIAS_PREFIX)):
            raise ContractError(
                f"{where}: env {key!r}: contract variables are read before the registry; set them in the pod"
            )
    env_pairs = tuple(sorted((k, str(v)) for k, v in env.items()))
    if not is_pooling(task):
        return KnownConfig(tp, positive("max_model_len"), positive("max_num_seqs"), env=env_pairs)
    shapes = entry.get("warmup_shapes")
    if not isinstance(shapes, list) or not shapes:
        raise ContractError(f"{where}: 'warmup_shapes' must be a list of [prompt_len, batch_size]")
    pairs = []
    for shape in shapes:
        if (
            not isinstance(shape, list)
            or len(shape) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape)
        ):
            raise ContractError(f"{where}: warmup shape {shape!r} is not [prompt_len, batch_size]")
        pairs.append((shape[0], shape[1]))
    return KnownConfig(tp, warmup_shapes=tuple(sorted(set(pairs))), env=env_pairs)


# ---- checking ------------------------------------------------------------------------------------


def pooling_pairs(shapes: Iterable[Shape]) -> tuple[tuple[int, int], ...]:
    return tuple(sorted({(s.prompt_len, s.batch_size) for s in shapes}))


def check_known_config(
    architecture: str,
    task: str = "generate",
    tensor_parallel_size: int = 1,
    max_model_len: int = 0,
    max_num_seqs: int = 0,
    shapes: Iterable[Shape | tuple[int, int]] = (),
    platform: str | None = None,
    model_config: Mapping | None = None,
    model_name: str = "",
    registry: Registry | None = None,
) -> Verdict:
    """Is this configuration known? `task`: generate | embed | score | rerank. `shapes` (pooling): Shape
    objects or (prompt_len, batch_size) pairs. `model_config`: config.json, when the caller has it (its
    `match` keys then tell apart models of one architecture). `platform`: default this machine's."""
    pairs = tuple(
        sorted({(s.prompt_len, s.batch_size) if isinstance(s, Shape) else tuple(s) for s in shapes})
    )
    requested = RequestedConfig(
        architecture=architecture,
        task="score" if task == "rerank" else task,
        tensor_parallel_size=tensor_parallel_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        shapes=pairs,
        platform=platform or current_platform(),
        model_config=model_config,
        model_name=model_name,
    )
    return check(requested, registry or _builtin())


def check(req: RequestedConfig, registry: Registry) -> Verdict:
    label = f"{req.model_name} ({req.architecture})" if req.model_name else req.architecture
    family = [m for m in registry.models if is_pooling(m.task) == is_pooling(req.task)]
    models = [m for m in family if m.matches(req.architecture, req.model_config)]
    what = f"{label} with {req.describe()} on {req.platform}"
    for model in models:
        for config in model.configs(req.platform):
            if _fits(req, config):
                return Verdict(True, f"known configuration: {what} ({model.name})", model, config)
    candidates = [(m, c) for m in models for c in m.configs(req.platform)]
    if not candidates:  # the model (or its platform) is unknown: look wider
        same_arch = [m for m in family if m.architecture == req.architecture]
        candidates = [(m, c) for m in (same_arch or family) for c in m.configs(req.platform)]
    if not candidates:
        candidates = [(m, c) for m in family for _, configs in m.platforms for c in configs]
    if not models:
        problem = "model not in the registry"
    elif not any(m.configs(req.platform) for m in models):
        problem = f"no known configuration on {req.platform}"
    else:
        problem = "configuration not in the registry"
    message = f"unknown configuration: {what}: {problem} ({registry.source})"
    if not candidates:
        return Verdict(
            False, f"{message}; it lists no {'pooling' if is_pooling(req.task) else 'decoder'} model"
        )
    model, config = min(candidates, key=lambda mc: _distance(req, mc[0], mc[1]))
    nearest = f"{model.name} ({model.architecture}) with {_nearest(req, config)}"
    return Verdict(False, f"{message}; nearest known: {nearest}", model, config)


def _nearest(req: RequestedConfig, c: KnownConfig) -> str:
    """The nearest configuration; for pooling models only the listed shapes nearest the missing ones."""
    missing = [s for s in req.shapes if s not in c.warmup_shapes]
    if not is_pooling(req.task) or not missing or not c.warmup_shapes:
        return c.describe()
    swaps = []
    for p, b in missing:
        kp, kb = min(c.warmup_shapes, key=lambda k: (_gap(p, k[0]) + _gap(b, k[1]), -k[0], -k[1]))
        swaps.append(f"[{kp}, {kb}] instead of [{p}, {b}]")
    return f"tensor_parallel_size={c.tensor_parallel_size}, warmup shape {'; '.join(swaps)}"


def _gap(a: int, b: int) -> float:
    return abs(math.log2(max(a, 1) / max(b, 1)))


def _fits(req: RequestedConfig, c: KnownConfig) -> bool:
    if req.tensor_parallel_size != c.tensor_parallel_size:
        return False
    if is_pooling(req.task):
        return bool(req.shapes) and set(req.shapes) <= set(c.warmup_shapes)
    return req.max_model_len <= c.max_model_len and req.max_num_seqs <= c.max_num_seqs


def _distance(req: RequestedConfig, model: KnownModel, c: KnownConfig) -> tuple:
    gap = _gap
    other_model = not model.matches(req.architecture, req.model_config)
    tp = gap(req.tensor_parallel_size, c.tensor_parallel_size)
    if is_pooling(req.task):
        missing = [s for s in req.shapes if s not in c.warmup_shapes]
        near = sum(
            min(gap(p, kp) + gap(b, kb) for kp, kb in c.warmup_shapes) if c.warmup_shapes else 99
            for p, b in missing
        )
        return (other_model, tp, len(missing), near)
    over = gap(req.max_model_len, c.max_model_len) + gap(req.max_num_seqs, c.max_num_seqs)
    return (other_model, tp, over)
