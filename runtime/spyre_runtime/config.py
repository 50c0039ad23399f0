"""Runtime configuration: parsed once from the environment contract (shared/DESIGN.md section 2) and the
command line, validated, frozen, and passed explicitly. A flag given on the command line wins over the
environment. Every problem raises ConfigError naming the variable (or flag) and the bad value."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from spyre_contract import (
    ALIAS_PREFIX,
    BACKENDS,
    CB_DEFAULT_CHUNK,
    CB_DEFAULT_MAX_MODEL_LEN,
    CB_DEFAULT_MAX_NUM_SEQS,
    CB_DEFAULT_MIXED_PREFILL_TOKENS,
    CB_DEFAULT_PREFILL_PIECES,
    CB_DEFAULT_STEP_COST_US,
    ENV_PREFIX,
    PROMPT_LEN_MULTIPLE,
    ContractError,
    EngineFlags,
    Env,
    Shape,
    batch_buckets,
    chunk_buckets,
    kv_buckets,
    parse_shapes,
    read_environment,
    round_up,
    static_batching_line,
)
from spyre_contract.architectures import check_batching, check_decoder_config
from spyre_contract.hybrid import HybridModelError, HybridSpec
from spyre_contract.memory import (
    DEFAULT_CARD_MEMORY_GIB,
    DTYPE_BYTES,
    GIB,
    ModelDims,
    host_memory_bytes,
    kv_blocks_for,
    kv_cache_dtype_for,
    plan_memory,
    resolved_dtype,
    volumetric_line,
)
from spyre_contract.registry import Verdict, check_known_config, load_registry, registry_settings
from spyre_contract.tasks import is_pooling_task, read_pooling_environment

log = logging.getLogger(__name__)

ConfigError = ContractError  # the rules live in the shared contract package (the operator runs them too)

CHUNK_ALIGN = 8  # dynamic chunks: a mixed step's chunk length is a multiple of this (at least this)

__all__ = [
    "ALIAS_PREFIX",
    "BACKENDS",
    "CB_DEFAULT_MAX_MODEL_LEN",
    "CB_DEFAULT_MAX_NUM_SEQS",
    "ENV_PREFIX",
    "ConfigError",
    "Env",
    "RuntimeConfig",
    "Shape",
    "load_config",
    "parse_shapes",
    "round_up",
]


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` (vllm/config/kv_events.py, 0.27.1), the same keys and defaults: where the
    prefix cache's block events are published (engine/kv_events.py). Off unless `enable_kv_cache_events`."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" when enabled and not given
    # a wildcard address, ipc:// or inproc:// binds; a host:port connects (vLLM's rule)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # a ROUTER socket that replays missed batches, when given
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @property
    def is_enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


KV_EVENTS_FLAG = "--kv-events-config"


@dataclass(frozen=True)
class RuntimeConfig:
    model_dir: Path
    served_model_name: str
    task: str = "generate"  # generate | embed | score | rerank (pooling: engine/pooling_client.py)
    backend: str = "sendnn"
    dtype: str = "auto"  # auto: the checkpoint's dtype on CPU backends, float16 for sendnn (loader.py)
    kv_cache_dtype: str = "auto"  # the KV cache's (auto: the model's; narrower on CPU backends only)
    memory_utilization: float = 0.0  # continuous batching: size the KV cache from this share of memory
    skip_warmup: bool = False  # development: compile on first use instead of at start-up
    use_cb: bool = False  # load_config: continuous for a decoder with no batching setting, static for pooling
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
    mixed_prefill_tokens: int = CB_DEFAULT_MIXED_PREFILL_TOKENS  # beside running decodes (0: the chunk)
    max_prefill_pieces: int = CB_DEFAULT_PREFILL_PIECES  # prompts a mixed step prefills pieces of, at most
    step_budget_ms: int = 0  # waves kept whole (engine/sched/waves.py): a step's time budget (0: off)
    step_cost_us: tuple[int, int, int] = CB_DEFAULT_STEP_COST_US  # fixed, per chunk token, per decode row
    wave_start: bool = True  # a wave's prompts start decoding together (engine/sched/wave_start.py)
    ngram_spec_tokens: int = 0  # n-gram drafts per request and step (engine/sched/speculation.py); 0: off
    max_batch_tkv_limit: int = 0  # Spyre's volumetric limit, and pausing (engine/sched/volume.py); 0: none
    pausing_enabled: bool = True
    long_output_priority: bool = False
    cpu_kernels: bool = True  # CPU backends: the C++ extension (SENDNN_INFERENCE_PAGED_ATTENTION_KERNEL)
    row_linear: bool = True  # its few-row linear, on a copy in panels (SENDNN_INFERENCE_ROW_LINEAR)
    shutdown_grace_seconds: float = 30.0
    max_num_batched_tokens: int = CB_DEFAULT_CHUNK  # continuous batching: prefill chunk, a multiple of 64
    enable_prefix_caching: bool = True
    num_kv_blocks: int = 0  # 0: room for max_num_seqs sequences of max_model_len tokens (+ scratch)
    decode_batch_buckets: tuple[int, ...] = ()  # () : powers of two up to max_num_seqs
    kv_len_buckets: tuple[int, ...] = ()  # () : 64 * powers of two up to max_model_len
    prefill_buckets: tuple[int, ...] = ()  # () : multiples of 64 up to 256, then doubling up to the chunk
    kv_events: KVEventsConfig = KVEventsConfig()  # --kv-events-config
    deprecated_env: tuple[str, ...] = field(default=(), compare=False)

    # ---- continuous batching: the static menu of compiled shapes ----------------------------------
    # Every decode step runs at a (batch size, KV length) bucket and every prefill chunk at a chunk-size
    # bucket; all of them are compiled at warmup (the Gaudi backend's bucketing, for static-shape backends).

    @property
    def chunk_buckets(self) -> tuple[int, ...]:
        return chunk_buckets(self.max_num_batched_tokens, self.prefill_buckets)

    @property
    def dynamic_chunks(self) -> bool:
        """Mixed steps on a CPU backend run at the chunk's own length (rounded up to CHUNK_ALIGN tokens) in
        one graph whose token dimension is dynamic (inductor) or in no graph (eager): no padding to a bucket,
        one graph instead of one per bucket. sendnn (static shapes only) and chunks run alone keep the
        chunk buckets."""
        return self.cp_interleave_steps and self.backend in ("inductor", "eager")

    @property
    def dynamic_decode(self) -> tuple[int, int] | None:
        """The decode batch buckets (min, max) that share one graph whose batch dimension is dynamic
        (inductor, continuous batching): every bucket above 1, one compile instead of one per bucket. A
        bucket of 1 keeps a graph of its own (dynamo specializes a size of 1); sendnn (static shapes only)
        keeps one per bucket, and eager compiles none. None: fewer than two buckets above 1."""
        shared = [b for b in self.batch_buckets if b > 1]
        if not self.use_cb or self.backend != "inductor" or len(shared) < 2:
            return None
        return min(shared), max(shared)

    @property
    def chunk_lengths(self) -> tuple[int, ...]:
        """The chunk lengths warm-up runs: every chunk bucket, or with dynamic chunks the shortest and the
        longest (one graph; the second run proves it serves both without compiling again)."""
        if self.dynamic_chunks:
            return (CHUNK_ALIGN, self.max_num_batched_tokens)
        return self.chunk_buckets

    @property
    def prefill_pieces(self) -> int:
        """Prompts a mixed step can prefill pieces of at once (each one's last token takes one more place
        beside the chunk bucket, and the paged prefill op loops over them): SENDNN_INFERENCE_CB_PREFILL_PIECES
        (default 4), or max_num_seqs when fewer; one without mixed steps."""
        return min(self.max_num_seqs, self.max_prefill_pieces) if self.cp_interleave_steps else 1

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        return batch_buckets(self.decode_batch_buckets, self.max_num_seqs)

    @property
    def kv_buckets(self) -> tuple[int, ...]:
        return kv_buckets(self.kv_len_buckets, self.max_model_len)

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
    dtype: str | None = None,
    task: str = "generate",
    kv_cache_dtype: str | None = None,
) -> RuntimeConfig:
    """Environment first, then flags (any argument that is not None wins). Pooling tasks read their
    own shapes (prompt length x batch size, spyre_contract.tasks)."""
    flags = EngineFlags(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        tensor_parallel_size=tensor_parallel_size,
        max_num_batched_tokens=max_num_batched_tokens,
        num_kv_blocks=num_kv_blocks,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
    )
    if port is not None and not 0 < port <= 65535:
        raise ConfigError(f"--port={port} must be between 1 and 65535")
    settings = (read_pooling_environment if is_pooling_task(task) else read_environment)(environ, flags)
    if settings.static_batching:  # a decoder asked for 1.x's mode: said once, at start-up
        log.info("%s", static_batching_line(settings.static_batching))
    contract = {f.name: getattr(settings, f.name) for f in fields(settings) if f.name in _CONFIG_FIELDS}
    model_path = Path(model_dir)
    config = RuntimeConfig(
        **contract,
        model_dir=model_path,
        served_model_name=served_model_name or model_path.name,
        task=task,
        host=host or "127.0.0.1",
        port=port or 8000,
        enable_prefix_caching=True if enable_prefix_caching is None else enable_prefix_caching,
        cache_dir=Path(settings.cache_dir) if settings.cache_dir else None,
        perf_metric_logging_dir=Path(settings.perf_metric_logging_dir),
    )
    if config.ngram_spec_tokens and not config.use_cb:
        log.info("n-gram speculation is off: it takes continuous batching (SENDNN_INFERENCE_USE_CB=1)")
        config = dataclasses.replace(config, ngram_spec_tokens=0)
    return hybrid_settings(config)


def hybrid_settings(config: RuntimeConfig) -> RuntimeConfig:
    """A hybrid (Mamba) model serves with prefix caching off, said in one line: its Mamba layers keep one
    state per sequence, not per KV block, so a cached prefix has no state to start from."""
    try:
        spec = HybridSpec.from_model_dir(config.model_dir)
    except HybridModelError as e:
        raise ConfigError(str(e)) from None
    if spec is None:
        return config
    log.info("hybrid (Mamba) model: prefix caching is off (a sequence's Mamba state is not kept per block)")
    if config.ngram_spec_tokens:
        log.info("hybrid (Mamba) model: n-gram speculation is off (its Mamba state cannot step back)")
    return dataclasses.replace(config, enable_prefix_caching=False, ngram_spec_tokens=0)


def hybrid_state_bytes(config: RuntimeConfig, dtype_bytes: int) -> int:
    """The Mamba state slots of a hybrid model (executor/families/hybrid/state.py), for the memory plan;
    else 0."""
    spec = HybridSpec.from_model_dir(config.model_dir)
    if spec is None:
        return 0
    slots = 1 + (config.max_num_seqs if config.use_cb else max(s.batch_size for s in config.shapes))
    return spec.state_bytes(slots, dtype_bytes)


_CONFIG_FIELDS = {f.name for f in fields(RuntimeConfig)} - {"cache_dir", "perf_metric_logging_dir"}


def check_known_configuration(config: RuntimeConfig, environ: Mapping[str, str] | None = None) -> Verdict:
    """The known-configurations registry at start-up: an unknown configuration is an error with
    SENDNN_INFERENCE_REQUIRE_KNOWN_CONFIG=1, else a warning. The caller applies `verdict.env`."""
    require, path = registry_settings(environ)
    registry = load_registry(path)
    try:
        model_config = json.loads((config.model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model directory {config.model_dir}: cannot read config.json ({e})") from None
    if not is_pooling_task(config.task):  # an architecture we cannot serve stops start-up here, in one line
        check_decoder_config(model_config, config.max_model_len)
        check_batching(model_config, config.use_cb)
    verdict = check_known_config(
        (model_config.get("architectures") or ["unknown"])[0],
        task=config.task,
        tensor_parallel_size=config.tensor_parallel_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        shapes=config.shapes if is_pooling_task(config.task) else (),
        model_config=model_config,
        model_name=config.served_model_name,
        registry=registry,
    )
    if verdict.is_known:
        log.debug("%s", verdict.message)  # stderr stays one line when start-up fails later
    elif require:
        raise ConfigError(f"{verdict.message} ({ENV_PREFIX}REQUIRE_KNOWN_CONFIG=1)")
    else:
        log.warning("%s; set %sREQUIRE_KNOWN_CONFIG=1 to refuse it", verdict.message, ENV_PREFIX)
    return verdict


def check_memory(
    config: RuntimeConfig,
    environ: Mapping[str, str] | None = None,
    routing: Callable[[str, str], str] | None = None,
) -> RuntimeConfig:
    """The memory plan before anything compiles: logged as a table, a warning above 90 %, a ConfigError
    naming the largest consumer when it cannot fit; with --memory-utilization and no --num-kv-blocks, the
    KV cache is sized from the memory left (the config returned carries the block count). Card memory for
    sendnn (SENDNN_INFERENCE_CARD_MEMORY_GIB, default 128), the cgroup limit or RAM (shared by the ranks)
    on CPU. `routing(dtype, backend)`: what this CPU's linear layers keep beside their weights (the caller's
    executor.linear.weight_routing, a layer above); without it, the most (a packed copy and panels)."""
    env = Env(environ)
    var, raw = env.raw("CARD_MEMORY_GIB")
    try:
        card_gib = float(raw) if raw not in (None, "") else DEFAULT_CARD_MEMORY_GIB
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not a number of GiB") from None
    if card_gib <= 0:
        raise ConfigError(f"{var}={raw!r} must be positive")
    model_config = json.loads((config.model_dir / "config.json").read_text())
    dims = ModelDims.from_config(model_config)
    dtype = resolved_dtype(config.backend, config.dtype, model_config)
    kv_dtype = kv_cache_dtype_for(config.backend, dtype, config.kv_cache_dtype)
    kv_bytes = DTYPE_BYTES.get(kv_dtype, 4)
    if config.backend == "sendnn":
        capacity, where = int(card_gib * GIB), "card"
    else:
        capacity, where = host_memory_bytes() // max(1, config.tensor_parallel_size), "host"
    if config.use_cb:  # the expanded menu, once
        logging.getLogger(__name__).info(
            "continuous batching menu: prefill chunks %s, decode batch sizes %s, KV lengths %s",
            f"of any length up to {config.max_num_batched_tokens} (one graph)"
            if config.dynamic_chunks
            else list(config.chunk_buckets),
            list(config.batch_buckets),
            list(config.kv_buckets),
        )
    if config.use_cb and config.max_batch_tkv_limit:  # Spyre's volumetric limit, beside the memory
        logging.getLogger(__name__).info("%s", volumetric_line(config))
    state = hybrid_state_bytes(config, DTYPE_BYTES.get(dtype, 4))  # a hybrid model's Mamba state
    kept = routing(dtype, config.backend) if routing else "packed"  # cards: plan_memory counts no copy
    plan = plan_memory(dims, config, capacity, where, DTYPE_BYTES.get(dtype, 4), state, kv_bytes, kept)
    logging.getLogger(__name__).info(
        "memory plan (%s, KV cache %s, tensor parallel %d):\n%s",
        dtype,
        kv_dtype,
        config.tensor_parallel_size,
        plan.table(),
    )
    if not plan.fits:
        raise ConfigError(plan.refusal())
    if config.use_cb and config.memory_utilization and not config.num_kv_blocks:
        per_block = PROMPT_LEN_MULTIPLE * 2 * dims.layers * dims.kv_heads * dims.head_dim
        per_block = per_block * kv_bytes // max(1, config.tensor_parallel_size)
        placed = dataclasses.replace(plan, activations=plan.activations + state)  # the Mamba state, first
        blocks = kv_blocks_for(placed, config.memory_utilization, per_block, config.min_kv_blocks)
        logging.getLogger(__name__).info(
            "--memory-utilization=%.2f: %d KV cache blocks of %d tokens (%.2f GiB)",
            config.memory_utilization,
            blocks,
            PROMPT_LEN_MULTIPLE,
            blocks * per_block / GIB,
        )
        config = dataclasses.replace(config, num_kv_blocks=blocks)
        plan = plan_memory(dims, config, capacity, where, DTYPE_BYTES.get(dtype, 4), state, kv_bytes, kept)
    if plan.is_tight:
        logging.getLogger(__name__).warning(
            "the memory plan uses %.0f%% of %s memory", 100 * plan.total / plan.capacity, where
        )
    return config
