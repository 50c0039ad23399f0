"""What a pod serves (`--task`) and the environment rules of pooling pods (embedding, score, rerank).

Pooling models run on static warm-up shapes only: `SENDNN_INFERENCE_WARMUP_PROMPT_LENS` and
`SENDNN_INFERENCE_WARMUP_BATCH_SIZES` zip into (prompt length, batch size) shapes; the decoders'
`WARMUP_NEW_TOKENS` does not apply and is ignored; continuous batching does not apply and is refused.
Pooling shapes are `Shape(prompt_len, 0, batch_size)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from spyre_contract.environment import (
    ENV_PREFIX,
    PROMPT_LEN_MULTIPLE,
    ContractError,
    EngineFlags,
    Env,
    EnvironmentSettings,
    Shape,
    read_environment,
)

TASKS = ("generate", "embed", "score", "rerank")
POOLING_TASKS = ("embed", "score", "rerank")
# a KV cache dtype other than auto (--kv-cache-dtype, spec.kvCacheDtype) on a pooling model would do nothing
NO_KV_CACHE = "has no effect on a pooling model, which keeps no KV cache; leave it auto"
_POOLING_ONLY_VARS = ("WARMUP_PROMPT_LENS", "WARMUP_NEW_TOKENS", "WARMUP_BATCH_SIZES", "USE_CB")


def is_pooling_task(task: str | None) -> bool:
    return task in POOLING_TASKS


def check_task(task: str | None) -> str | None:
    """None or "auto": detect from the model folder. Anything else must be one of TASKS."""
    if task is None or task == "auto":
        return None
    if task not in TASKS:
        raise ContractError(f"--task={task!r} is not one of auto, {', '.join(TASKS)}")
    return task


def parse_pooling_shapes(env: Env) -> tuple[Shape, ...]:
    """Zips WARMUP_PROMPT_LENS with WARMUP_BATCH_SIZES into (prompt_len, 0, batch_size) shapes."""
    p_var, prompt_lens = env.int_list("WARMUP_PROMPT_LENS", "64")
    b_var, batch_sizes = env.int_list("WARMUP_BATCH_SIZES", "1")
    if len(prompt_lens) != len(batch_sizes):
        raise ContractError(
            f"warmup lists differ in length: {p_var} has {len(prompt_lens)}, {b_var} has "
            f"{len(batch_sizes)} entries"
        )
    for p in prompt_lens:
        if p % PROMPT_LEN_MULTIPLE:
            raise ContractError(f"{p_var}: {p} is not a multiple of {PROMPT_LEN_MULTIPLE}")
    return tuple(sorted({Shape(p, 0, b) for p, b in zip(prompt_lens, batch_sizes, strict=True)}))


def read_pooling_environment(
    environ: Mapping[str, str] | None = None, flags: EngineFlags | None = None
) -> EnvironmentSettings:
    """The contract's variables for a pooling pod: every rule of `read_environment`, with pooling shapes.
    `max_model_len` is the longest warm-up prompt and `max_num_seqs` the widest batch; flags may lower
    them but never raise them; one card only (encoders are small); no KV cache dtype (they keep none)."""
    env = Env(environ)
    flags = flags or EngineFlags()
    if env.bool("USE_CB", False):
        raise ContractError(
            f"{env.raw('USE_CB')[0]}=1 applies to decoders; pooling models run on static warm-up shapes"
        )
    shapes = parse_pooling_shapes(env)
    prefixes = tuple(ENV_PREFIX + name for name in _POOLING_ONLY_VARS)
    rest = {k: v for k, v in env.environ.items() if k not in prefixes}
    flags_left = dataclasses.replace(flags, max_model_len=None, max_num_seqs=None)
    settings = read_environment(rest, flags_left, pooling=True)
    if settings.kv_cache_dtype != "auto":
        setting = "--kv-cache-dtype" if flags.kv_cache_dtype is not None else env.raw("KV_CACHE_DTYPE")[0]
        raise ContractError(f"{setting}={settings.kv_cache_dtype!r} {NO_KV_CACHE}")
    longest = max(s.prompt_len for s in shapes)
    widest = max(s.batch_size for s in shapes)
    for flag, value, limit, what in (
        ("--max-model-len", flags.max_model_len, longest, "the longest warm-up prompt length"),
        ("--max-num-seqs", flags.max_num_seqs, widest, "the widest warm-up batch size"),
    ):
        if value is not None and value > limit:
            raise ContractError(f"{flag}={value} is larger than {what} ({limit}) of a pooling model")
    if settings.tensor_parallel_size != 1:
        raise ContractError(
            f"--tensor-parallel-size={settings.tensor_parallel_size}: pooling models run on one card"
        )
    return dataclasses.replace(
        settings,
        shapes=shapes,
        use_cb=False,
        max_model_len=flags.max_model_len or longest,
        max_num_seqs=flags.max_num_seqs or widest,
        deprecated_env=tuple(dict.fromkeys((*env.deprecated_used, *settings.deprecated_env))),
    )
