"""The executor: loads an FMS model, compiles its forward for the warmed static shapes, and runs steps.

It makes no policy decisions: it receives a step description from the scheduler, builds fixed-shape
tensors (left-padded prompts, dummy rows), runs the compiled forward and samples one token per row.
After warmup, serving runs under torch.compiler's "fail_on_recompile" stance: a step that would compile
raises instead of silently compiling.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from spyre_runtime import kv_cache
from spyre_runtime.config import ConfigError, RuntimeConfig, Shape
from spyre_runtime.kv_cache import BLOCK_SIZE, SCRATCH_BLOCK, KVCachePool, blocks_for
from spyre_runtime.sampling import sample_batch
from spyre_runtime.scheduler import StaticStep

log = logging.getLogger(__name__)


def compiler_for(backend: str):
    """Returns the torch.compile backend, or None for eager. torch_sendnn is imported only for sendnn."""
    if backend == "eager":
        return None
    if backend == "sendnn":
        try:
            import torch_sendnn  # noqa: F401  (registers the "sendnn" dynamo backend)
        except ImportError:
            raise ConfigError(
                "SENDNN_INFERENCE_DYNAMO_BACKEND=sendnn needs the torch_sendnn package (IBM Spyre stack), "
                "which is not installed; on CPU use SENDNN_INFERENCE_DYNAMO_BACKEND=inductor or eager"
            ) from None
    return backend


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


def load_fms_model(model_dir: Path):
    from fms.models import get_model

    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model directory {model_dir} has no config.json")
    model = get_model("hf_pretrained", model_path=str(model_dir), device_type="cpu", data_type=torch.float32)
    model.eval()
    return model


class ModelExecutor:
    def __init__(self, config: RuntimeConfig, model=None) -> None:
        self.config = config
        kv_cache.register()
        self.model = model if model is not None else load_fms_model(config.model_dir)
        self.dims = model_dims(self.model)
        self._prime_rotary(max(config.max_model_len, max(s.max_len for s in config.shapes)))
        num_blocks = 1 + max(s.batch_size * blocks_for(s.max_len) for s in config.shapes)
        self.kv = KVCachePool(self.dims.num_layers, num_blocks, self.dims.kv_heads, self.dims.head_dim)
        backend = compiler_for(config.backend)
        self._step_fn = (
            self._forward if backend is None else torch.compile(self._forward, backend=backend, dynamic=False)
        )
        self.is_warm = False
        self.warmup_seconds: float | None = None
        self.shape_seconds: dict[Shape, float] = {}

    def _prime_rotary(self, max_len: int) -> None:
        """Fills FMS's rotary-frequency cache before compiling, so tracing never mutates it."""
        from fms.modules.positions import RotaryEmbedding

        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding):
                module.compute_freqs_cis(torch.device("cpu"), max(max_len, 2048))

    # ---- the compiled hot step -------------------------------------------------------------------

    def _forward(self, input_ids, position_ids, mask, slot_mapping, block_table=None, slab_start=None):
        # input_ids, position_ids, slot_mapping: [B, L]; mask: [B, L, K]; block_table: [B, nb] -> [B, V]
        kwargs = {"mask": mask, "slot_mapping": slot_mapping}
        if block_table is not None:
            kwargs["block_table"] = block_table
        if slab_start is not None:
            kwargs["slab_start"] = slab_start
        logits, _ = self.model(
            input_ids,
            position_ids=position_ids,
            past_key_value_states=self.kv.layers,
            use_cache=True,
            last_n_tokens=1,
            attn_name=kv_cache.ATTN_NAME,
            **kwargs,
        )
        return logits[:, -1, :]

    def _run(self, *args) -> torch.Tensor:
        with torch.inference_mode():
            if self.is_warm and self.config.backend != "eager":
                with torch.compiler.set_stance("fail_on_recompile"):
                    return self._step_fn(*args)
            return self._step_fn(*args)

    # ---- static shapes ---------------------------------------------------------------------------

    def row_blocks(self, shape: Shape) -> torch.Tensor:
        """[B, nb]: row r owns blocks 1 + r*nb ... (one batch runs at a time, so shapes share them)."""
        nb = blocks_for(shape.max_len)
        return torch.arange(1, 1 + shape.batch_size * nb, dtype=torch.long).view(shape.batch_size, nb)

    def prefill_inputs(self, shape: Shape, prompts: list[list[int]]):
        B, P = shape.batch_size, shape.prompt_len
        ids = torch.zeros(B, P, dtype=torch.long)
        pos = torch.zeros(B, P, dtype=torch.long)
        slots = torch.full((B, P), SCRATCH_BLOCK * BLOCK_SIZE, dtype=torch.long)
        mask = torch.eye(P, dtype=torch.bool).expand(B, P, P).clone()
        causal = torch.ones(P, P, dtype=torch.bool).tril()
        logical = torch.arange(P)
        blocks = self.row_blocks(shape)
        for r, prompt in enumerate(prompts):
            n = len(prompt)
            pad = P - n
            ids[r, pad:] = torch.tensor(prompt, dtype=torch.long)
            pos[r, pad:] = torch.arange(n)
            slots[r] = blocks[r, logical // BLOCK_SIZE] * BLOCK_SIZE + logical % BLOCK_SIZE
            mask[r, pad:, pad:] = causal[pad:, pad:]
        return ids, pos, mask, slots

    def decode_inputs(self, shape: Shape, prompt_lens: list[int], last_tokens: list[int], t: int):
        B, P = shape.batch_size, shape.prompt_len
        blocks = self.row_blocks(shape)
        nb = blocks.shape[1]
        K = nb * BLOCK_SIZE
        cur = P + t  # logical slot of this step's token
        ids = torch.zeros(B, 1, dtype=torch.long)
        pos = torch.zeros(B, 1, dtype=torch.long)
        slots = torch.full((B, 1), SCRATCH_BLOCK * BLOCK_SIZE, dtype=torch.long)
        mask = torch.zeros(B, 1, K, dtype=torch.bool)
        mask[:, 0, 0] = True  # dummy rows see one key of their own slab (finite: zeros or old keys)
        keys = torch.arange(K)
        for r, (n, token) in enumerate(zip(prompt_lens, last_tokens, strict=True)):
            ids[r, 0] = token
            pos[r, 0] = n + t
            slots[r, 0] = blocks[r, cur // BLOCK_SIZE] * BLOCK_SIZE + cur % BLOCK_SIZE
            mask[r, 0] = (keys >= P - n) & (keys <= cur)
        return ids, pos, mask, slots, None, int(blocks[0, 0])

    def execute_static(self, step: StaticStep) -> list[int]:
        """Runs one step; returns one sampled token per request of the step (dummy rows dropped)."""
        reqs = step.requests
        if step.is_prefill:
            args = self.prefill_inputs(step.shape, [r.prompt_token_ids for r in reqs])
        else:
            args = self.decode_inputs(
                step.shape,
                [r.num_prompt_tokens for r in reqs],
                [r.output_token_ids[-1] for r in reqs],
                step.decode_index,
            )
        logits = self._run(*args)
        return sample_batch(logits[: len(reqs)], [r.sampling for r in reqs], [r.generator for r in reqs])

    # ---- warmup ----------------------------------------------------------------------------------

    def warmup(self) -> float:
        """Compiles and runs the prefill and decode graphs of every shape."""
        t_all = time.monotonic()
        graphs = 2 * len(self.config.shapes)
        with torch._dynamo.config.patch(
            recompile_limit=max(8, graphs + 2), accumulated_recompile_limit=max(256, graphs * 2)
        ):
            for shape in self.config.shapes:
                t0 = time.monotonic()
                prompts = [[1] * shape.prompt_len] * shape.batch_size
                self._run(*self.prefill_inputs(shape, prompts))
                self._run(
                    *self.decode_inputs(
                        shape, [shape.prompt_len] * shape.batch_size, [1] * shape.batch_size, 0
                    )
                )
                self.shape_seconds[shape] = time.monotonic() - t0
                log.info("Warmup of shape %s took %.2f s", shape, self.shape_seconds[shape])
        self.warmup_seconds = time.monotonic() - t_all
        self.is_warm = True
        log.info("Warmup finished in %.2f s", self.warmup_seconds)
        return self.warmup_seconds
