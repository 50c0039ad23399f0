"""The one place a batching policy is chosen: continuous batching when the configuration says so (a decoder
with no batching setting, or SENDNN_INFERENCE_USE_CB=1), with waves kept whole when a step's time budget is
set (SENDNN_INFERENCE_CB_STEP_BUDGET_MS, waves.py), else static batching over the warm-up shapes."""

from __future__ import annotations

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.sched.continuous import ContinuousScheduler
from spyre_runtime.engine.sched.interface import GenerateScheduler
from spyre_runtime.engine.sched.static import StaticScheduler
from spyre_runtime.engine.sched.waves import WaveScheduler


def make_scheduler(config: RuntimeConfig) -> GenerateScheduler:
    if not config.use_cb:
        return StaticScheduler(config.shapes)
    return WaveScheduler(config) if config.step_budget_ms else ContinuousScheduler(config)
