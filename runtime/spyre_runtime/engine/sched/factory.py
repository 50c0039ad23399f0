"""The one place a batching policy is chosen: continuous batching when the configuration says so (a decoder
with no batching setting, or SENDNN_INFERENCE_USE_CB=1), else static batching over the warm-up shapes."""

from __future__ import annotations

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.sched.continuous import ContinuousScheduler
from spyre_runtime.engine.sched.interface import GenerateScheduler
from spyre_runtime.engine.sched.static import StaticScheduler


def make_scheduler(config: RuntimeConfig) -> GenerateScheduler:
    return ContinuousScheduler(config) if config.use_cb else StaticScheduler(config.shapes)
