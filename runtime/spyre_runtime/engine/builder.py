"""An engine is built in one place: compute threads -> engine (model loaded) -> warm-up of every shape,
through the graph cache when it is enabled. The offline `LLM` (llm.py), the server's engine clients
(client.py, pooling_client.py) and the `compile` command all build here.

    build_engine(config)         a decoder: LLMEngine, warmed
    build_pooling(config, spec)  a pooling model (embed, score, rerank) and its tokenizer, warmed
    compile_graphs(config)       a compile Job: the model compiled (not loaded to run), its graphs cached
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.llm_engine import LLMEngine
from spyre_runtime.executor.families.pooling import (
    PoolingModel,
    PoolingSpec,
    check_shapes,
    detect_pooling,
    load_pooling_model,
    shapes_str,
)
from spyre_runtime.executor.graph_cache import WarmupResult, warmup_with_cache
from spyre_runtime.executor.kv_cache import BLOCK_SIZE
from spyre_runtime.executor.model_executor import ModelExecutor, configure_threads

KV_BLOCK_SIZE = BLOCK_SIZE  # token slots per KV-cache block (the prefix cache's unit)


@dataclass
class BuiltEngine:
    engine: LLMEngine
    threads: int  # compute threads configured
    load_seconds: float
    warmup: WarmupResult | None  # None: built without warm-up


def build_engine(
    config: RuntimeConfig, warmup: bool = True, on_loaded: Callable[[LLMEngine], None] | None = None
) -> BuiltEngine:
    """Threads -> engine -> warm-up. `on_loaded(engine)` runs once the model is loaded, before the
    warm-up (the server publishes its KV-cache configuration then)."""
    t0 = time.monotonic()
    threads = configure_threads(config)
    engine = LLMEngine(config)
    load_seconds = time.monotonic() - t0
    if on_loaded is not None:
        on_loaded(engine)
    warm = warmup_with_cache(engine.executor, config) if warmup else None
    return BuiltEngine(engine, threads, load_seconds, warm)


def pooling_spec(config: RuntimeConfig) -> PoolingSpec:
    """What the folder's pooling model is, checked against the warm-up shapes (a ConfigError names what
    is wrong: the server calls this before it binds its port)."""
    spec = detect_pooling(config.model_dir, config.task)
    check_shapes(config, spec)
    return spec


def describe_shapes(config: RuntimeConfig) -> str:
    """The warm-up shapes as a 400 names them."""
    return shapes_str(config.shapes)


@dataclass
class BuiltPooling:
    model: PoolingModel
    tokenizer: object
    warmup: WarmupResult


def build_pooling(config: RuntimeConfig, spec: PoolingSpec) -> BuiltPooling:
    """Threads -> tokenizer and model (padded with the tokenizer's pad token) -> warm-up of every shape."""
    from transformers import AutoTokenizer

    configure_threads(config)
    tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model = PoolingModel(config, spec, pad_id)
    warm = warmup_with_cache(model, config)  # the graph cache, when enabled
    return BuiltPooling(model, tokenizer, warm)


def compile_graphs(config: RuntimeConfig, pooling: bool) -> WarmupResult:
    """Threads -> the model compiled only -> warm-up into the graph cache; the model is released after."""
    configure_threads(config)
    executor = (
        load_pooling_model(config, compile_only=True) if pooling else ModelExecutor(config, compile_only=True)
    )
    try:
        return warmup_with_cache(executor, config)
    finally:
        executor.close()
