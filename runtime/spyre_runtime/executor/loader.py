"""Loading, the general part: the process's thread pool, the decoder's dtype and dimensions, and what is done
to its weights once before anything compiles: the linear weights packed for oneDNN and the rotary-frequency
cache filled. Loading the weights themselves goes by the model's family (families/rooms.py)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from spyre_contract.memory import resolved_dtype

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.executor import linear

log = logging.getLogger(__name__)


def cgroup_cpu_limit() -> int | None:
    """CPUs allowed by the cgroup v2 (cpu.max) or v1 (cfs quota) limit, or None when unlimited."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            return max(1, int(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        if quota > 0:
            return max(1, quota // period)
    except (OSError, ValueError):
        pass
    return None


def configure_threads(config: RuntimeConfig) -> int:
    """Sizes torch's thread pool from SENDNN_INFERENCE_NUM_CPUS, else the cgroup quota, else the CPU count."""
    if not config.update_thread_config:
        return torch.get_num_threads()
    cpus = config.num_cpus or cgroup_cpu_limit() or len(os.sched_getaffinity(0))
    threads = max(1, cpus // config.tensor_parallel_size)
    torch.set_num_threads(threads)
    return threads


@dataclass(frozen=True)
class ModelDims:
    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int


def model_dims(model) -> ModelDims:
    from fms.modules.attention import MultiHeadAttention

    attns = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if not attns:
        raise ValueError("the model has no FMS MultiHeadAttention layers")
    first = attns[0]
    vocab = getattr(model.config, "src_vocab_size", None)
    return ModelDims(len(attns), first.nheads, first.kvheads, first.emb_kq_per_head, vocab)


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, backend: str, model_dir: Path) -> torch.dtype:
    """--dtype to a torch dtype. `auto`: float16 for sendnn (what Spyre cards run), else the checkpoint's
    dtype from config.json (`dtype` or `torch_dtype`), float32 when it names none or an unknown one."""
    if dtype != "auto" or backend == "sendnn":
        return TORCH_DTYPES[resolved_dtype(backend, dtype, None)]
    try:
        hf = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return torch.float32
    return TORCH_DTYPES[resolved_dtype(backend, dtype, hf)]


def pack_weights(model: torch.nn.Module, config: RuntimeConfig, dtype: torch.dtype) -> bool:
    """Every step runs its GEMMs through the packed linear op, on weights prepacked for oneDNN, tuned for the
    largest decode batch (linear.py; one more copy of the linear weights in memory), or, where oneDNN cannot
    pack the dtype (bfloat16 on an AVX2-only x86), on the plain weights, every row on the row linear.
    False where the layers stay as they are (Spyre, float16)."""
    rows = max(config.batch_buckets) if config.use_cb else max(s.batch_size for s in config.shapes)
    routed = linear.can_route(dtype, config.backend)
    if routed:
        n = linear.pack_linears(model, rows)
        if linear.can_pack(dtype, config.backend):
            log.info("linear layers: %d run on weights prepacked for oneDNN (tuned for %d rows)", n, rows)
        else:
            log.info("linear layers: %d run on plain %s weights (oneDNN cannot pack them here)", n, dtype)
    return routed


def prime_rotary(model: torch.nn.Module, max_len: int) -> None:
    """Gives the rotary embeddings the elementwise form that inductor vectorizes and fills their frequency
    cache before compiling, so tracing never mutates it (rotary.py). FMS's position encoders are not
    modules: until run 31 this looked for them among the modules and filled nothing."""
    from spyre_runtime.executor.rotary import rotary_encoders, use_pairwise_rotary

    use_pairwise_rotary(model)
    for encoder in rotary_encoders(model):
        encoder.compute_freqs_cis(torch.device("cpu"), max(max_len, 2048))


_bare_hf = threading.RLock()


@contextlib.contextmanager
def without_hf_adapters() -> Iterator[None]:
    """Within: FMS's HF loading (`get_model("hf_pretrained")`, `fms.models.hf.config_utils`) imports only the
    modules it uses. `fms/models/hf/__init__.py` (ibm-fms 1.13.1) imports the HF adapter of every family FMS
    has, and with them transformers' modeling code and its losses (scipy), none of it used to load a
    checkpoint: 2.2 s of CPU on their own, 1.8 s less at a tiny model's server start (9.0 -> 7.2 CPU-s with
    accelerate gone too; the rest is imported by other paths anyway). So
    `fms.models.hf` is a bare package here (its submodules import, its __init__ does not run) and every
    `fms.models.hf` module is dropped again on the way out: an import of the package afterwards runs it
    whole, as it would have. Objects taken from those modules stay valid. Where the package was imported
    already, nothing changes."""
    with _bare_hf:
        if "fms.models.hf" in sys.modules:
            yield
            return
        spec = importlib.util.find_spec("fms.models.hf")
        sys.modules["fms.models.hf"] = importlib.util.module_from_spec(spec)  # (not executed)
        try:
            yield
        finally:
            for name in [n for n in sys.modules if n == "fms.models.hf" or n.startswith("fms.models.hf.")]:
                del sys.modules[name]
