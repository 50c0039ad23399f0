"""The operator <-> runtime environment contract (shared/DESIGN.md section 2) in one place.

The runtime reads its settings through `read_environment`; the operator calls the same function on the
environment and flags it is about to give a pod, so a spec the runtime would refuse is refused before any
pod exists. Neither side keeps a copy of these rules. This package imports neither side."""

from spyre_contract.buckets import (
    PROMPT_LEN_MULTIPLE,
    batch_buckets,
    chunk_buckets,
    doubling,
    expand_range,
    kv_buckets,
    round_up,
)
from spyre_contract.environment import (
    ALIAS_PREFIX,
    BACKEND_ALIASES,
    BACKENDS,
    CB_DEFAULT_CHUNK,
    CB_DEFAULT_MAX_MODEL_LEN,
    CB_DEFAULT_MAX_NUM_SEQS,
    CB_DEFAULT_MIXED_PREFILL_TOKENS,
    CB_DEFAULT_PREFILL_PIECES,
    CB_DEFAULT_STEP_COST_US,
    DTYPES,
    ENV_PREFIX,
    ContractError,
    EngineFlags,
    Env,
    EnvironmentSettings,
    Shape,
    parse_shapes,
    read_environment,
    static_batching_line,
)
from spyre_contract.registry import Verdict, check_known_config, load_registry, registry_settings
from spyre_contract.tasks import POOLING_TASKS, TASKS, is_pooling_task, read_pooling_environment

__all__ = [
    "ALIAS_PREFIX",
    "BACKENDS",
    "BACKEND_ALIASES",
    "CB_DEFAULT_CHUNK",
    "CB_DEFAULT_MAX_MODEL_LEN",
    "CB_DEFAULT_MAX_NUM_SEQS",
    "CB_DEFAULT_MIXED_PREFILL_TOKENS",
    "CB_DEFAULT_PREFILL_PIECES",
    "CB_DEFAULT_STEP_COST_US",
    "DTYPES",
    "ENV_PREFIX",
    "POOLING_TASKS",
    "PROMPT_LEN_MULTIPLE",
    "TASKS",
    "ContractError",
    "EngineFlags",
    "Env",
    "EnvironmentSettings",
    "Shape",
    "Verdict",
    "batch_buckets",
    "check_known_config",
    "chunk_buckets",
    "doubling",
    "expand_range",
    "is_pooling_task",
    "kv_buckets",
    "load_registry",
    "parse_shapes",
    "read_environment",
    "read_pooling_environment",
    "registry_settings",
    "round_up",
    "static_batching_line",
]
