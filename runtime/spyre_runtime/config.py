"""Runtime configuration: parsed once from the environment contract (shared/DESIGN.md section 2) and the
command line, validated, frozen, and passed explicitly. A flag given on the command line wins over the
environment. Every problem raises ConfigError naming the variable (or flag) and the bad value."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

BACKENDS = ("sendnn", "inductor", "eager")
PROMPT_LEN_MULTIPLE = 64
CB_DEFAULT_MAX_MODEL_LEN = 512
CB_DEFAULT_MAX_NUM_SEQS = 4
CB_DEFAULT_CHUNK = 256
ENV_PREFIX = "SENDNN_INFERENCE_"
ALIAS_PREFIX = "VLLM_SPYRE_"


class ConfigError(ValueError):
    """A bad setting; the message is one readable line naming the variable or flag."""


@dataclass(frozen=True, order=True)
class Shape:
    """One warmed static shape: prompts of up to `prompt_len` tokens, up to `new_tokens` generated
    tokens, `batch_size` rows. Ordered smallest first."""

    prompt_len: int
    new_tokens: int
    batch_size: int

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.new_tokens

    def fits(self, num_prompt_tokens: int, max_tokens: int) -> bool:
        return num_prompt_tokens <= self.prompt_len and max_tokens <= self.new_tokens

    def __str__(self) -> str:
        return f"(prompt_len={self.prompt_len}, new_tokens={self.new_tokens}, batch_size={self.batch_size})"


class Env:
    """Reads `SENDNN_INFERENCE_<NAME>`, falling back to the deprecated `VLLM_SPYRE_<NAME>` alias."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ = dict(os.environ if environ is None else environ)
        self.deprecated_used: list[str] = []

    def raw(self, name: str, full: bool = False) -> tuple[str, str | None]:
        """Returns (variable name actually read, value or None). `full`: `name` is already complete."""
        if full:
            return name, self.environ.get(name)
        canonical, alias = ENV_PREFIX + name, ALIAS_PREFIX + name
        if canonical in self.environ:
            return canonical, self.environ[canonical]
        if alias in self.environ:
            if alias not in self.deprecated_used:
                self.deprecated_used.append(alias)
                log.warning("%s is deprecated; use %s", alias, canonical)
            return alias, self.environ[alias]
        return canonical, None

    def str(self, name: str, default: str, full: bool = False) -> str:
        value = self.raw(name, full)[1]
        return default if value is None or value == "" else value

    def int(self, name: str, default: int, minimum: int | None = None, full: bool = False) -> int:
        var, value = self.raw(name, full)
        if value is None or value.strip() == "":
            return default
        try:
            parsed = int(value.strip())
        except ValueError:
            raise ConfigError(f"{var}={value!r} is not an integer") from None
        if minimum is not None and parsed < minimum:
            raise ConfigError(f"{var}={value!r} must be >= {minimum}")
        return parsed

    def bool(self, name: str, default: bool, full: bool = False) -> bool:
        var, value = self.raw(name, full)
        if value is None or value.strip() == "":
            return default
        lowered = value.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{var}={value!r} is not a boolean (use 1 or 0)")

    def int_list(self, name: str, default: str) -> tuple[str, list[int]]:
        var, value = self.raw(name)
        text = default if value is None or value.strip() == "" else value
        items = [item.strip() for item in text.split(",")]
        numbers = []
        for item in items:
            try:
                numbers.append(int(item))
            except ValueError:
                raise ConfigError(f"{var}={text!r}: {item!r} is not an integer") from None
            if numbers[-1] <= 0:
                raise ConfigError(f"{var}={text!r}: {item} must be positive")
        return var, numbers


def parse_shapes(env: Env) -> tuple[Shape, ...]:
    """Zips the three warmup lists into shapes (shared/DESIGN.md section 2)."""
    p_var, prompt_lens = env.int_list("WARMUP_PROMPT_LENS", "64")
    n_var, new_tokens = env.int_list("WARMUP_NEW_TOKENS", "20")
    b_var, batch_sizes = env.int_list("WARMUP_BATCH_SIZES", "1")
    if not len(prompt_lens) == len(new_tokens) == len(batch_sizes):
        raise ConfigError(
            f"warmup lists differ in length: {p_var} has {len(prompt_lens)}, {n_var} has "
            f"{len(new_tokens)}, {b_var} has {len(batch_sizes)} entries"
        )
    for p in prompt_lens:
        if p % PROMPT_LEN_MULTIPLE:
            raise ConfigError(f"{p_var}: {p} is not a multiple of {PROMPT_LEN_MULTIPLE}")
    return tuple(
        sorted({Shape(p, n, b) for p, n, b in zip(prompt_lens, new_tokens, batch_sizes, strict=True)})
    )


@dataclass(frozen=True)
class RuntimeConfig:
    model_dir: Path
    served_model_name: str
    backend: str = "sendnn"
    use_cb: bool = False
    shapes: tuple[Shape, ...] = (Shape(64, 20, 1),)
    max_model_len: int = 84
    max_num_seqs: int = 1
    tensor_parallel_size: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    cache_enabled: bool = False
    cache_dir: Path | None = None
    require_precompiled: bool = False
    max_load_processes: int = 0
    gloo_timeout_minutes: int = 60
    worker_log_redirect_dir: str = ""
    perf_metric_logging_enabled: bool = False
    perf_metric_logging_dir: Path = Path("/tmp")
    override_signals_handler: bool = True
    update_thread_config: bool = True
    num_cpus: int = 0
    cp_interleave_steps: bool = True
    shutdown_grace_seconds: float = 30.0
    max_num_batched_tokens: int = CB_DEFAULT_CHUNK  # continuous batching: prefill chunk, a multiple of 64
    enable_prefix_caching: bool = True
    num_kv_blocks: int = 0  # 0: room for max_num_seqs sequences of max_model_len tokens (+ scratch)
    decode_batch_buckets: tuple[int, ...] = ()  # () : powers of two up to max_num_seqs
    kv_len_buckets: tuple[int, ...] = ()  # () : 64 * powers of two up to max_model_len
    deprecated_env: tuple[str, ...] = field(default=(), compare=False)

    # ---- continuous batching: the static menu of compiled shapes ----------------------------------
    # Every decode step runs at a (batch size, KV length) bucket and every prefill chunk at a chunk-size
    # bucket; all of them are compiled at warmup (the Gaudi backend's bucketing, for static-shape backends).

    @property
    def chunk_buckets(self) -> tuple[int, ...]:
        """Every multiple of 64 up to 256 (short prompts pad little), then doubling up to the chunk size."""
        fine = range(PROMPT_LEN_MULTIPLE, min(256, self.max_num_batched_tokens) + 1, PROMPT_LEN_MULTIPLE)
        return tuple(sorted(set(fine) | set(_doubling(256, self.max_num_batched_tokens))))

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        return self.decode_batch_buckets or _doubling(1, self.max_num_seqs)

    @property
    def kv_buckets(self) -> tuple[int, ...]:
        return self.kv_len_buckets or _doubling(PROMPT_LEN_MULTIPLE, round_up(self.max_model_len))

    @property
    def blocks_per_sequence(self) -> int:
        return round_up(self.max_model_len) // PROMPT_LEN_MULTIPLE

    @property
    def min_kv_blocks(self) -> int:
        """Scratch plus one sequence of max_model_len tokens: any single request can always run."""
        return 1 + self.blocks_per_sequence

    @property
    def cb_num_blocks(self) -> int:
        return self.num_kv_blocks or 1 + self.max_num_seqs * self.blocks_per_sequence


def round_up(n: int, multiple: int = PROMPT_LEN_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def _doubling(start: int, top: int) -> tuple[int, ...]:
    """start, 2*start, 4*start, ... below top, then top itself."""
    values, v = [], start
    while v < top:
        values.append(v)
        v *= 2
    return (*values, top)


def load_config(
    model_dir: str | Path,
    environ: Mapping[str, str] | None = None,
    served_model_name: str | None = None,
    host: str | None = None,
    port: int | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    tensor_parallel_size: int | None = None,
    max_num_batched_tokens: int | None = None,
    enable_prefix_caching: bool | None = None,
    num_kv_blocks: int | None = None,
) -> RuntimeConfig:
    """Environment first, then flags (any argument that is not None wins)."""
    env = Env(environ)
    backend = env.str("DYNAMO_BACKEND", "sendnn").strip().lower()
    if backend not in BACKENDS:
        var = env.raw("DYNAMO_BACKEND")[0]
        raise ConfigError(f"{var}={backend!r} is not one of {', '.join(BACKENDS)}")
    shapes = parse_shapes(env)
    use_cb = env.bool("USE_CB", False)
    longest = max(s.max_len for s in shapes)
    widest = max(s.batch_size for s in shapes)
    for flag, value in (
        ("--max-model-len", max_model_len),
        ("--max-num-seqs", max_num_seqs),
        ("--tensor-parallel-size", tensor_parallel_size),
        ("--port", port),
        ("--max-num-batched-tokens", max_num_batched_tokens),
        ("--num-kv-blocks", num_kv_blocks),
    ):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag}={value} must be positive")
    if port is not None and port > 65535:
        raise ConfigError(f"--port={port} must be at most 65535")
    model_path = Path(model_dir)
    cache_enabled = env.bool("TORCH_SENDNN_CACHE_ENABLE", False, full=True)
    cache_dir_text = env.str("TORCH_SENDNN_CACHE_DIR", "", full=True)
    if cache_enabled and not cache_dir_text:
        raise ConfigError("TORCH_SENDNN_CACHE_ENABLE=1 needs TORCH_SENDNN_CACHE_DIR")
    if use_cb:  # limits of their own, not the static shapes'
        longest, widest = CB_DEFAULT_MAX_MODEL_LEN, CB_DEFAULT_MAX_NUM_SEQS
    chunk = max_num_batched_tokens or CB_DEFAULT_CHUNK
    if chunk % PROMPT_LEN_MULTIPLE:
        raise ConfigError(f"--max-num-batched-tokens={chunk} is not a multiple of {PROMPT_LEN_MULTIPLE}")
    config = RuntimeConfig(
        model_dir=model_path,
        served_model_name=served_model_name or model_path.name,
        backend=backend,
        use_cb=use_cb,
        shapes=shapes,
        max_model_len=max_model_len or longest,
        max_num_seqs=max_num_seqs or widest,
        max_num_batched_tokens=chunk,
        enable_prefix_caching=True if enable_prefix_caching is None else enable_prefix_caching,
        num_kv_blocks=num_kv_blocks or 0,
        decode_batch_buckets=_buckets(env, "CB_DECODE_BATCH_SIZES", 1),
        kv_len_buckets=_buckets(env, "CB_KV_LENS", PROMPT_LEN_MULTIPLE),
        tensor_parallel_size=tensor_parallel_size or 1,
        host=host or "127.0.0.1",
        port=port or 8000,
        cache_enabled=cache_enabled,
        cache_dir=Path(cache_dir_text) if cache_dir_text else None,
        require_precompiled=env.bool("REQUIRE_PRECOMPILED_DECODERS", False),
        max_load_processes=env.int("MAX_LOAD_PROCESSES", 0, minimum=0),
        gloo_timeout_minutes=env.int("GLOO_TIMEOUT_MINUTES", 60, minimum=1),
        worker_log_redirect_dir=env.str("WORKER_LOG_REDIRECT_DIR", ""),
        perf_metric_logging_enabled=env.bool("PERF_METRIC_LOGGING_ENABLED", False),
        perf_metric_logging_dir=Path(env.str("PERF_METRIC_LOGGING_DIR", "/tmp")),
        override_signals_handler=env.bool("OVERRIDE_SIGNALS_HANDLER", True),
        update_thread_config=env.bool("UPDATE_THREAD_CONFIG", True),
        num_cpus=env.int("NUM_CPUS", 0, minimum=0),
        cp_interleave_steps=env.bool("CP_INTERLEAVE_STEPS", True),
        deprecated_env=tuple(env.deprecated_used),
    )
    if use_cb:
        _check_cb_limits(config, env)
    return config


def _buckets(env: Env, name: str, multiple: int) -> tuple[int, ...]:
    if env.raw(name)[1] in (None, ""):
        return ()
    var, values = env.int_list(name, "")
    for v in values:
        if v % multiple:
            raise ConfigError(f"{var}: {v} is not a multiple of {multiple}")
    return tuple(sorted(set(values)))


def _check_cb_limits(config: RuntimeConfig, env: Env) -> None:
    if config.num_kv_blocks and config.num_kv_blocks < config.min_kv_blocks:
        raise ConfigError(
            f"--num-kv-blocks={config.num_kv_blocks} cannot hold one sequence of --max-model-len="
            f"{config.max_model_len} tokens; it needs at least {config.min_kv_blocks} blocks"
        )
    if max(config.batch_buckets) < config.max_num_seqs:
        raise ConfigError(
            f"{env.raw('CB_DECODE_BATCH_SIZES')[0]}: the largest bucket {max(config.batch_buckets)} is below "
            f"--max-num-seqs={config.max_num_seqs}"
        )
    if max(config.kv_buckets) < config.max_model_len:
        raise ConfigError(
            f"{env.raw('CB_KV_LENS')[0]}: the largest bucket {max(config.kv_buckets)} is below "
            f"--max-model-len={config.max_model_len}"
        )
