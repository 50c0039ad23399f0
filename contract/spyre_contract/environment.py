"""Every rule of the environment contract: variable names, aliases, value syntax, and the rules that tie
the variables to the engine flags (shapes, continuous-batching limits and buckets). Each problem raises
ContractError, one readable line naming the variable (or flag) and the bad value."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from spyre_contract.buckets import PROMPT_LEN_MULTIPLE, batch_buckets, expand_range, kv_buckets, round_up

log = logging.getLogger(__name__)

BACKENDS = ("sendnn", "inductor", "eager")
BACKEND_ALIASES = {"sendnn_decoder": "sendnn"}  # the v1 configuration docs' spelling
DTYPES = ("auto", "float32", "bfloat16", "float16")
CB_DEFAULT_MAX_MODEL_LEN = 512
CB_DEFAULT_MAX_NUM_SEQS = 4
CB_DEFAULT_CHUNK = 256
CB_DEFAULT_MIXED_PREFILL_TOKENS = 0  # 0: the chunk (bench/README.md run 20: 64 gave ITL p99 0.68x, 2x TTFT)
CB_DEFAULT_PREFILL_PIECES = 4  # prompts one mixed step prefills pieces of, at most (..._CB_PREFILL_PIECES)
CB_DEFAULT_STEP_BUDGET_MS = 0  # waves kept whole by a step cost (0: off): fixed, per token, per row µs
CB_DEFAULT_STEP_COST_US = (34000, 900, 2600)
ENV_PREFIX = "SENDNN_INFERENCE_"
ALIAS_PREFIX = "VLLM_SPYRE_"  # 1.x's prefix: sendnn-inference 2.x no longer reads it, so neither do we
# Spyre's volumetric limit: a decode step's rows x context (tkv) stay at or under it (known configurations
# set it; sendnn-inference reads the same name)
TKV_LIMIT_VAR = "VLLM_DT_MAX_BATCH_TKV_LIMIT"
RETIRED = {  # variables sendnn-inference 2.x removed, and what replaces each (one start-up line each)
    "VLLM_DT_CHUNK_LEN": "the prefill chunk is --max-num-batched-tokens (a multiple of 64)",
    "SENDNN_INFERENCE_USE_CHUNKED_PREFILL": "continuous batching always prefills in chunks of "
    "--max-num-batched-tokens; remove it",
}
# a decoder's static batching is shaped by these (1.x's mode; sendnn-inference 2.x reads them for pooling)
STATIC_SHAPE_VARS = ("WARMUP_PROMPT_LENS", "WARMUP_NEW_TOKENS", "WARMUP_BATCH_SIZES")


class ContractError(ValueError):
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


def retired_variables(environ: Mapping[str, str]) -> list[str]:
    """One line for each variable sendnn-inference 2.x renamed or removed, naming what replaces it."""
    lines = []
    for name in sorted(environ):
        if name.startswith(ALIAS_PREFIX):
            new = ENV_PREFIX + name.removeprefix(ALIAS_PREFIX)
            lines.append(f"{name} is no longer read (sendnn-inference 2.x renamed it): use {new}")
        elif name in RETIRED:
            lines.append(f"{name} is gone in sendnn-inference 2.x: {RETIRED[name]}")
    return lines


class Env:
    """Reads `SENDNN_INFERENCE_<NAME>`; a variable 2.x renamed or removed (`VLLM_SPYRE_<NAME>`,
    `VLLM_DT_CHUNK_LEN`) stops start-up with a line naming its replacement."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ = dict(os.environ if environ is None else environ)
        self.deprecated_used: list[str] = []
        if retired := retired_variables(self.environ):
            raise ContractError("; ".join(retired))

    def raw(self, name: str, full: bool = False) -> tuple[str, str | None]:
        """Returns (variable name actually read, value or None). `full`: `name` is already complete."""
        if full:
            return name, self.environ.get(name)
        canonical = ENV_PREFIX + name
        return canonical, self.environ.get(canonical)

    def deprecate(self, old: str, new: str) -> None:
        if old not in self.deprecated_used:
            self.deprecated_used.append(old)
            log.warning("%s is deprecated; use %s", old, new)

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
            raise ContractError(f"{var}={value!r} is not an integer") from None
        if minimum is not None and parsed < minimum:
            raise ContractError(f"{var}={value!r} must be >= {minimum}")
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
        raise ContractError(f"{var}={value!r} is not a boolean (use 1 or 0)")

    def int_list(self, name: str, default: str) -> tuple[str, list[int]]:
        var, value = self.raw(name)
        text = default if value is None or value.strip() == "" else value
        items = [item.strip() for item in text.split(",")]
        numbers = []
        for item in items:
            try:
                numbers.append(int(item))
            except ValueError:
                raise ContractError(f"{var}={text!r}: {item!r} is not an integer") from None
            if numbers[-1] <= 0:
                raise ContractError(f"{var}={text!r}: {item} must be positive")
        return var, numbers


def parse_shapes(env: Env) -> tuple[Shape, ...]:
    """Zips the three warmup lists into shapes (shared/DESIGN.md section 2)."""
    p_var, prompt_lens = env.int_list("WARMUP_PROMPT_LENS", "64")
    n_var, new_tokens = env.int_list("WARMUP_NEW_TOKENS", "20")
    b_var, batch_sizes = env.int_list("WARMUP_BATCH_SIZES", "1")
    if not len(prompt_lens) == len(new_tokens) == len(batch_sizes):
        raise ContractError(
            f"warmup lists differ in length: {p_var} has {len(prompt_lens)}, {n_var} has "
            f"{len(new_tokens)}, {b_var} has {len(batch_sizes)} entries"
        )
    for p in prompt_lens:
        if p % PROMPT_LEN_MULTIPLE:
            raise ContractError(f"{p_var}: {p} is not a multiple of {PROMPT_LEN_MULTIPLE}")
    return tuple(
        sorted({Shape(p, n, b) for p, n, b in zip(prompt_lens, new_tokens, batch_sizes, strict=True)})
    )


def decoder_batching(env: Env) -> tuple[bool, str]:
    """(continuous?, what chose static batching). A decoder with no batching setting runs continuous batching
    with chunked prefill and prefix caching, as sendnn-inference 2.x does (its only mode for decoders);
    `SENDNN_INFERENCE_USE_CB=0`, or warm-up shapes without `SENDNN_INFERENCE_USE_CB`, choose static batching
    over the warm-up shapes: 1.x's mode, kept as an explicit choice."""
    var, raw = env.raw("USE_CB")
    if raw is not None and raw.strip():
        use_cb = env.bool("USE_CB", True)
        return use_cb, "" if use_cb else f"{var}={raw.strip()}"
    shaped = [env.raw(name)[0] for name in STATIC_SHAPE_VARS if (env.raw(name)[1] or "").strip()]
    return (False, f"{shaped[0]} without {var}") if shaped else (True, "")


def static_batching_line(chosen_by: str) -> str:
    """The start-up line of a decoder on static batching: what chose it, and that it is 1.x's mode."""
    return (
        f"static batching over the warm-up shapes ({chosen_by}): sendnn-inference 1.x's mode; 2.x runs "
        f"decoders with continuous batching only (chunked prefill, prefix caching), as {ENV_PREFIX}USE_CB=1 "
        "or no batching setting does here"
    )


@dataclass(frozen=True)
class EngineFlags:
    """The command-line flags that shape the engine (None: not given)."""

    max_model_len: int | None = None
    max_num_seqs: int | None = None
    tensor_parallel_size: int | None = None
    max_num_batched_tokens: int | None = None
    num_kv_blocks: int | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None


@dataclass(frozen=True)
class EnvironmentSettings:
    """Everything the contract's variables and the engine flags say, validated together."""

    backend: str = "sendnn"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # the KV cache's own dtype (auto: the model's)
    use_cb: bool = False  # read_environment: True for a decoder with no batching setting (decoder_batching)
    static_batching: str = ""  # a decoder on static batching: what chose it (static_batching_line)
    shapes: tuple[Shape, ...] = (Shape(64, 20, 1),)
    max_model_len: int = 84
    max_num_seqs: int = 1
    tensor_parallel_size: int = 1
    max_num_batched_tokens: int = CB_DEFAULT_CHUNK
    num_kv_blocks: int = 0
    decode_batch_buckets: tuple[int, ...] = ()
    kv_len_buckets: tuple[int, ...] = ()
    prefill_buckets: tuple[int, ...] = ()
    cache_enabled: bool = False
    cache_dir: str = ""
    require_precompiled: bool = False
    max_load_processes: int = 0
    gloo_timeout_minutes: int = 60
    worker_log_redirect_dir: str = ""
    perf_metric_logging_enabled: bool = False
    perf_metric_logging_dir: str = "/tmp"
    override_signals_handler: bool = True
    update_thread_config: bool = True
    num_cpus: int = 0
    cp_interleave_steps: bool = True
    mixed_prefill_tokens: int = CB_DEFAULT_MIXED_PREFILL_TOKENS
    max_prefill_pieces: int = CB_DEFAULT_PREFILL_PIECES
    step_budget_ms: int = CB_DEFAULT_STEP_BUDGET_MS
    step_cost_us: tuple[int, int, int] = CB_DEFAULT_STEP_COST_US
    wave_start: bool = True
    ngram_spec_tokens: int = 0  # drafts a decoding request's n-gram lookup proposes a step (0: off)
    max_batch_tkv_limit: int = 0  # rows x context of a decode step, at most (0: no limit)
    pausing_enabled: bool = True
    long_output_priority: bool = False
    cpu_kernels: bool = True  # CPU backends: the C++ extension (SENDNN_INFERENCE_PAGED_ATTENTION_KERNEL)
    row_linear: bool = True  # its few-row linear, on a copy in panels (SENDNN_INFERENCE_ROW_LINEAR)
    deprecated_env: tuple[str, ...] = field(default=(), compare=False)


def read_environment(
    environ: Mapping[str, str] | None = None, flags: EngineFlags | None = None, pooling: bool = False
):
    """Parses and checks the contract's variables (environment) and the engine flags (a flag wins).
    `pooling`: static batching, always (spyre_contract.tasks reads the pooling shapes); else the decoder's
    choice (decoder_batching)."""
    env = Env(environ)
    flags = flags or EngineFlags()
    for flag, value in (
        ("--max-model-len", flags.max_model_len),
        ("--max-num-seqs", flags.max_num_seqs),
        ("--tensor-parallel-size", flags.tensor_parallel_size),
        ("--max-num-batched-tokens", flags.max_num_batched_tokens),
        ("--num-kv-blocks", flags.num_kv_blocks),
    ):
        if value is not None and value <= 0:
            raise ContractError(f"{flag}={value} must be positive")
    backend = _backend(env)
    dtype = _dtype(env, flags.dtype)
    shapes = parse_shapes(env)
    use_cb, static_batching = (False, "") if pooling else decoder_batching(env)
    longest = max(s.max_len for s in shapes)
    widest = max(s.batch_size for s in shapes)
    if use_cb:  # limits of their own, not the static shapes'
        longest, widest = CB_DEFAULT_MAX_MODEL_LEN, CB_DEFAULT_MAX_NUM_SEQS
    chunk = flags.max_num_batched_tokens or CB_DEFAULT_CHUNK
    if chunk % PROMPT_LEN_MULTIPLE:
        raise ContractError(f"--max-num-batched-tokens={chunk} is not a multiple of {PROMPT_LEN_MULTIPLE}")
    cache_enabled = env.bool("TORCH_SENDNN_CACHE_ENABLE", False, full=True)
    cache_dir = env.str("TORCH_SENDNN_CACHE_DIR", "", full=True)
    if cache_enabled and not cache_dir:
        raise ContractError("TORCH_SENDNN_CACHE_ENABLE=1 needs TORCH_SENDNN_CACHE_DIR")
    settings = EnvironmentSettings(
        backend=backend,
        dtype=dtype,
        kv_cache_dtype=_dtype(env, flags.kv_cache_dtype, "KV_CACHE_DTYPE", "--kv-cache-dtype"),
        use_cb=use_cb,
        static_batching=static_batching,
        shapes=shapes,
        max_model_len=flags.max_model_len or longest,
        max_num_seqs=flags.max_num_seqs or widest,
        tensor_parallel_size=flags.tensor_parallel_size or 1,
        max_num_batched_tokens=chunk,
        num_kv_blocks=flags.num_kv_blocks or 0,
        decode_batch_buckets=_buckets(env, "CB_DECODE_BATCH_SIZES", 1, "CB_DECODE_BATCH_BUCKETS"),
        kv_len_buckets=_buckets(env, "CB_KV_LENS", PROMPT_LEN_MULTIPLE, "CB_KV_BUCKETS"),
        prefill_buckets=_buckets(env, "CB_PREFILL_SIZES", PROMPT_LEN_MULTIPLE, "CB_PREFILL_BUCKETS"),
        cache_enabled=cache_enabled,
        cache_dir=cache_dir,
        require_precompiled=env.bool("REQUIRE_PRECOMPILED_DECODERS", False),
        max_load_processes=env.int("MAX_LOAD_PROCESSES", 0, minimum=0),
        gloo_timeout_minutes=env.int("GLOO_TIMEOUT_MINUTES", 60, minimum=1),
        worker_log_redirect_dir=env.str("WORKER_LOG_REDIRECT_DIR", ""),
        perf_metric_logging_enabled=env.bool("PERF_METRIC_LOGGING_ENABLED", False),
        perf_metric_logging_dir=env.str("PERF_METRIC_LOGGING_DIR", "/tmp"),
        override_signals_handler=env.bool("OVERRIDE_SIGNALS_HANDLER", True),
        update_thread_config=env.bool("UPDATE_THREAD_CONFIG", True),
        num_cpus=env.int("NUM_CPUS", 0, minimum=0),
        cp_interleave_steps=env.bool("CP_INTERLEAVE_STEPS", True),
        mixed_prefill_tokens=env.int("CB_MIXED_PREFILL_TOKENS", CB_DEFAULT_MIXED_PREFILL_TOKENS, minimum=0),
        max_prefill_pieces=env.int("CB_PREFILL_PIECES", CB_DEFAULT_PREFILL_PIECES, minimum=1),
        step_budget_ms=env.int("CB_STEP_BUDGET_MS", CB_DEFAULT_STEP_BUDGET_MS, minimum=0),
        step_cost_us=_step_cost(env),
        wave_start=env.bool("CB_WAVE_START", True),
        ngram_spec_tokens=env.int("CB_NGRAM_SPEC_TOKENS", 0, minimum=0),
        max_batch_tkv_limit=env.int(TKV_LIMIT_VAR, 0, minimum=0, full=True),
        pausing_enabled=env.bool("PAUSING_ENABLED", True),
        long_output_priority=env.bool("LONG_OUT_PRIO", False),
        cpu_kernels=env.bool("PAGED_ATTENTION_KERNEL", True),
        row_linear=env.bool("ROW_LINEAR", True),
        deprecated_env=tuple(env.deprecated_used),
    )
    if use_cb:
        _check_cb_limits(settings, env, chunk_given=flags.max_num_batched_tokens is not None)
    return settings


def _step_cost(env: Env) -> tuple[int, int, int]:
    var, parts = env.int_list("CB_STEP_COST_US", ",".join(map(str, CB_DEFAULT_STEP_COST_US)))
    if len(parts) != 3:
        raise ContractError(f"{var} needs 3 integers: fixed,per-token,per-row microseconds, not {len(parts)}")
    return parts[0], parts[1], parts[2]


def _backend(env: Env) -> str:
    var, raw = env.raw("DYNAMO_BACKEND")
    backend = (raw or "sendnn").strip().lower() or "sendnn"
    if backend in BACKEND_ALIASES:
        env.deprecate(f"{var}={backend}", f"{var}={BACKEND_ALIASES[backend]}")
        backend = BACKEND_ALIASES[backend]
    if backend not in BACKENDS:
        raise ContractError(f"{var}={backend!r} is not one of {', '.join(BACKENDS)}")
    return backend


def _dtype(env: Env, flag: str | None, name: str = "DTYPE", flag_name: str = "--dtype") -> str:
    var, value = (flag_name, flag) if flag is not None else env.raw(name)
    dtype = (value or "auto").strip().lower() or "auto"
    if dtype not in DTYPES:
        raise ContractError(f"{var}={dtype!r} is not one of {', '.join(DTYPES)}")
    return dtype


def _buckets(env: Env, name: str, multiple: int, range_name: str = "") -> tuple[int, ...]:
    """A comma list (`name`) or a `min,step,max` range (`range_name`), not both."""
    has_list = env.raw(name)[1] not in (None, "")
    if range_name and env.raw(range_name)[1] not in (None, ""):
        if has_list:
            raise ContractError(
                f"{env.raw(name)[0]} and {env.raw(range_name)[0]} exclude each other: set one"
            )
        var, parts = env.int_list(range_name, "")
        if len(parts) != 3:
            raise ContractError(f"{var}={','.join(map(str, parts))!r} must be min,step,max")
        bmin, step, bmax = parts
        if bmin > bmax:
            raise ContractError(f"{var}: min {bmin} is above max {bmax}")
        values = expand_range(bmin, step, bmax)
        for v in values:
            if v % multiple:
                raise ContractError(f"{var}: the range gives {v}, not a multiple of {multiple}")
        return values
    if not has_list:
        return ()
    var, values = env.int_list(name, "")
    for v in values:
        if v % multiple:
            raise ContractError(f"{var}: {v} is not a multiple of {multiple}")
    return tuple(sorted(set(values)))


def _check_cb_limits(s: EnvironmentSettings, env: Env, chunk_given: bool) -> None:
    blocks_per_sequence = round_up(s.max_model_len) // PROMPT_LEN_MULTIPLE
    if s.num_kv_blocks and s.num_kv_blocks < 1 + blocks_per_sequence:
        raise ContractError(
            f"--num-kv-blocks={s.num_kv_blocks} cannot hold one sequence of --max-model-len="
            f"{s.max_model_len} tokens; it needs at least {1 + blocks_per_sequence} blocks"
        )
    fillers = min(s.max_num_seqs, s.max_prefill_pieces) if s.cp_interleave_steps else 1
    if chunk_given and s.max_num_batched_tokens > fillers * round_up(s.max_model_len):
        raise ContractError(
            f"--max-num-batched-tokens={s.max_num_batched_tokens} is larger than {fillers} prompt(s) of "
            f"--max-model-len={s.max_model_len} (rounded up to {round_up(s.max_model_len)}; a step prefills "
            "pieces of at most SENDNN_INFERENCE_CB_PREFILL_PIECES prompts, --max-num-seqs when fewer, one "
            "without SENDNN_INFERENCE_CP_INTERLEAVE_STEPS): no step fills such a chunk"
        )
    if s.prefill_buckets and max(s.prefill_buckets) < s.max_num_batched_tokens:
        var = env.raw("CB_PREFILL_BUCKETS" if env.raw("CB_PREFILL_BUCKETS")[1] else "CB_PREFILL_SIZES")[0]
        raise ContractError(
            f"{var}: the largest bucket {max(s.prefill_buckets)} is below --max-num-batched-tokens="
            f"{s.max_num_batched_tokens} (a full chunk would fit no graph)"
        )
    largest_batch = max(batch_buckets(s.decode_batch_buckets, s.max_num_seqs))
    if largest_batch < s.max_num_seqs:
        raise ContractError(
            f"{env.raw('CB_DECODE_BATCH_SIZES')[0]}: the largest bucket {largest_batch} is below "
            f"--max-num-seqs={s.max_num_seqs}"
        )
    largest_kv = max(kv_buckets(s.kv_len_buckets, s.max_model_len))
    if largest_kv < s.max_model_len:
        raise ContractError(
            f"{env.raw('CB_KV_LENS')[0]}: the largest bucket {largest_kv} is below "
            f"--max-model-len={s.max_model_len}"
        )
