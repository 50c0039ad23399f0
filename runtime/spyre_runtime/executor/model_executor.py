"""The executor: loads an FMS model, compiles its forward for the warmed static shapes, and runs steps.

It makes no policy decisions: it receives a step description from the scheduler, builds fixed-shape
tensors (left-padded prompts, dummy rows), runs the compiled forward and samples one token per row.
After warmup, serving runs under torch.compiler's "fail_on_recompile" stance: a step that would compile
raises instead of silently compiling.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from spyre_runtime.config import CHUNK_ALIGN, ConfigError, RuntimeConfig, Shape
from spyre_runtime.executor.graph_cache import loading
from spyre_runtime.executor.kv_cache import BLOCK_SIZE, SCRATCH_BLOCK, KVCachePool, blocks_for
from spyre_runtime.executor import kv_cache, linear
from spyre_runtime.executor.warmup import WarmupProgress
from spyre_runtime.executor.workers import WorkerGroup
from spyre_runtime.sampling.sampler import SamplerOutput, sample
from spyre_runtime.steps import ContinuousStep, PrefillChunk, StaticStep

log = logging.getLogger(__name__)


def compiler_for(backend: str, compile_only: bool = False):
    """Returns the torch.compile backend, or None for eager. torch_sendnn is imported only for sendnn;
    `compile_only` (a precompile Job) uses its card-less `sendnn_compile_only` backend."""
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
        if compile_only:
            return "sendnn_compile_only"
    return backend


def compile_step(fn, backend_name: str, compile_only: bool = False):
    """The compiled hot step (static shapes); eager returns `fn` itself. fullgraph: a graph break would
    split the forward and run Python between its pieces; it fails instead."""
    backend = compiler_for(backend_name, compile_only)
    if backend is None:
        return fn
    return torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's stack of decoder blocks: its longest ModuleList whose modules are all of one class."""
    best: list[torch.nn.Module] = []
    for module in model.modules():
        same_class = isinstance(module, torch.nn.ModuleList) and len({type(m) for m in module}) == 1
        if same_class and len(module) > len(best):
            best = list(module)
    return best


# SmolLM2 (30 blocks), a decode step at batch 8 / a 256-token mixed step / warm-up from the inductor cache:
# whole model in one graph 122 ms / 1064 ms / 38 s; 30 calls of 1 block 136 / 1089 / 7 s; 5 calls of 6
# blocks 127 / 1075 / 11 s (bench/README.md, run 11)
MAX_BLOCK_CALLS = 5


def block_group_size(num_blocks: int, max_calls: int | None = None) -> int:
    """Blocks per compiled call: the fewest (a divisor of `num_blocks`) that need at most `max_calls`."""
    calls = max_calls or MAX_BLOCK_CALLS
    return next(k for k in range(1, num_blocks + 1) if num_blocks % k == 0 and num_blocks // k <= calls)


def _pass_through(x, *, past_key_value_state=None, use_cache=False, **_):
    """A block whose group's first block already ran it (BlockCompiler)."""
    return (x, past_key_value_state) if use_cache else x


def without_parameter_guards(entries) -> list[bool]:
    """Which of dynamo's guards a block group's graph keeps: all but the tensor guards on the blocks'
    parameters. Every group passes its own parameters to the one graph the groups share, and they never
    change after load; they were most of the tensors checked per call (about 36 of 6 blocks), and a decode
    step makes 5 calls. Everything else stays: guards on the step's tensors and arguments (which
    tell the decode graph of each bucket and the mixed graph apart), the dynamic range, global state, and
    the blocks' constant attributes (blocks that differ in one still compile graphs of their own). Parameters
    of another shape cannot slip through: the compiled graph checks the size and stride of every input."""
    return [not (e.guard_type == "TENSOR_MATCH" and isinstance(e.value, torch.nn.Parameter)) for e in entries]


class BlockCompiler:
    """Regional compilation (inductor): a group of `group` consecutive decoder blocks is compiled once, and
    every group of the stack runs that one graph (blocks differ only in their weights and KV cache tensors,
    which are graph inputs), while the thin rest of the forward (embedding, final norm, LM head, picking the
    last tokens) runs eagerly around it. Dynamo traces and inductor compiles `group` blocks instead of the
    whole stack per shape, so warm-up is several times shorter, cold (no cache) and warm (with the graph
    cache dynamo still traces on every start: tracing the whole model was most of a warm start). Each call
    of the graph costs guard checks and wrappers (about 0.8 ms here), so the stack runs in a few calls, not
    one per block: the first block of a group runs the group, the others pass their input through.

    `dynamic_tokens` (min, max): while set, the hidden states are marked dynamic in their token dimension
    (dim 1), for the mixed step's one graph of any chunk length (see `_mark_dynamic_chunk`)."""

    def __init__(self, model: torch.nn.Module, backend, kv_layers: list) -> None:
        blocks = repeated_blocks(model)
        if len(blocks) < 2 or len(blocks) != len(kv_layers):
            raise ConfigError(f"{type(model).__name__}: no stack of decoder blocks to compile")
        self.group = block_group_size(len(blocks))
        forward = type(blocks[0]).forward

        def group_step(members, x, kv_states, **kwargs):
            for block, kv in zip(members, kv_states, strict=True):
                out = forward(block, x, past_key_value_state=kv, **kwargs)
                x = out[0] if isinstance(out, tuple) else out
            return x

        self.compiled = torch.compile(
            group_step,
            backend=backend,
            dynamic=False,
            fullgraph=True,
            options={"guard_filter_fn": without_parameter_guards},
        )
        self.dynamic_tokens: tuple[int, int] | None = None
        for first in range(0, len(blocks), self.group):
            members = blocks[first : first + self.group]
            members[0].forward = functools.partial(self._call, members, kv_layers, first)
            for block in members[1:]:
                block.forward = _pass_through

    def _call(self, members, kv_layers, first, x, *, past_key_value_state=None, use_cache=False, **kwargs):
        if self.dynamic_tokens is not None:
            low, high = self.dynamic_tokens
            torch._dynamo.mark_dynamic(x, 1, min=low, max=high)
        kvs = tuple(kv_layers[first : first + len(members)])
        x = self.compiled(members, x, kvs, use_cache=use_cache, **kwargs)
        return (x, past_key_value_state) if use_cache else x


def _cache_tag_pass(tag: str):
    """A post-grad pass that changes nothing and puts `tag` in inductor's FX-graph cache key (inductor
    hashes a custom pass by its uuid()). A graph with a dynamic dimension is cached with the range it was
    compiled for; without the tag, a later compile of the same graph for a wider range (another token
    budget) hits that entry, inherits its narrower bound and fails at warm-up (ConstraintViolationError)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class CacheTag(CustomGraphPass):  # inductor bypasses its cache for a pass of any other class
        def __call__(self, graph) -> None:
            return None

        def uuid(self) -> str:
            return tag

    return CacheTag()


def compile_settings(backend: str, cache_enabled: bool = False, freeze: bool = True, cache_tag: str = ""):
    """Inductor settings while a graph is traced and compiled (warmup). With `freeze` off (the decoder's
    linear layers already run on weights prepacked at run time, linear.py) nothing is changed: the weights
    stay graph inputs, so compiling is shorter and a cached graph holds no copy of them (measured on SmolLM2,
    two graphs: cold 64 s instead of 72, warm from the inductor cache 13 s instead of 24, same decode step).
    Otherwise `freezing` turns the weights into
    constants, folded and prepacked for oneDNN (2-3x faster small-batch GEMMs on CPU). It must be on while
    dynamo traces, not only while inductor compiles: dynamo installs the parameters as graph attributes
    (constants) only then; otherwise they are graph inputs and nothing is frozen. The KV cache tensors are
    never parameters: they stay graph inputs, mutated in place. With the graph cache on, the weights are not
    prepacked as mkldnn tensors: those cannot be pickled, so the compiled graph would bypass the cache and
    every start would compile again (frozen, unpacked weights cache fine). `cache_tag`: see
    _cache_tag_pass."""
    if backend != "inductor":
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    settings = {"post_grad_custom_post_pass": _cache_tag_pass(cache_tag)} if cache_tag else {}
    if freeze:
        settings |= {"freezing": True, "cpp.weight_prepack": not cache_enabled}
    return inductor_config.patch(settings)


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
    if dtype != "auto":
        return TORCH_DTYPES[dtype]
    if backend == "sendnn":
        return torch.float16
    try:
        hf = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return torch.float32
    return TORCH_DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype")), torch.float32)


def load_fms_model(model_dir: Path, tensor_parallel: bool = False, dtype: torch.dtype = torch.float32):
    """The whole model, or with `tensor_parallel` this rank's shard (FMS's "tp" strategy over the default
    process group, which must already be initialized)."""
    from fms.models import get_model

    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model directory {model_dir} has no config.json")
    kwargs = {"distributed_strategy": "tp", "group": torch.distributed.group.WORLD} if tensor_parallel else {}
    model = get_model(
        "hf_pretrained", model_path=str(model_dir), device_type="cpu", data_type=dtype, **kwargs
    )
    model.eval()
    return model


class ModelExecutor:
    def __init__(self, config: RuntimeConfig, model=None, compile_only: bool = False, rank: int = 0) -> None:
        """On rank 0 with --tensor-parallel-size N > 1 this spawns ranks 1..N-1 (see workers.py)."""
        self.config = config
        kv_cache.register()
        tp = config.tensor_parallel_size > 1
        self.workers = WorkerGroup(config) if tp and rank == 0 else None
        self.dtype = resolve_dtype(config.dtype, config.backend, config.model_dir)
        if model is None:
            with loading(config):
                model = load_fms_model(config.model_dir, tensor_parallel=tp, dtype=self.dtype)
        else:
            self.dtype = next(model.parameters()).dtype
        if tp:
            # every rank has loaded (and left its load slot) before rank 0 may take a slot to compile
            torch.distributed.barrier()
        self.model = model
        self.dims = model_dims(self.model)
        self._pack_weights()
        self._prime_rotary(max(config.max_model_len, max(s.max_len for s in config.shapes)))
        self.prefill_kv_len = max(config.kv_buckets)  # chunks see up to the longest KV bucket
        self.decode_table_width = blocks_for(config.max_model_len)  # blocks of the longest sequence
        if config.use_cb:
            num_blocks = config.cb_num_blocks
        else:
            num_blocks = 1 + max(s.batch_size * blocks_for(s.max_len) for s in config.shapes)
        self.kv = KVCachePool(
            self.dims.num_layers, num_blocks, self.dims.kv_heads, self.dims.head_dim, dtype=self.dtype
        )
        self.blocks = None
        if config.backend == "inductor":
            self.blocks = BlockCompiler(self.model, compiler_for(config.backend), self.kv.layers)
            self._step_fn = self._forward
        else:
            self._step_fn = compile_step(self._forward, config.backend, compile_only)
        self.is_warm = False
        self.warmup_seconds: float | None = None
        self.shape_seconds: dict[Shape, float] = {}
        self.progress = WarmupProgress()  # graphs warmed so far, for the log, /health and a gauge

    def _pack_weights(self) -> None:
        """Every step runs its GEMMs on weights prepacked for oneDNN, tuned for the largest decode batch
        (linear.py); one more copy of the linear weights in memory."""
        cfg = self.config
        rows = max(cfg.batch_buckets) if cfg.use_cb else max(s.batch_size for s in cfg.shapes)
        self.packed = linear.can_pack(self.dtype, cfg.backend)
        if self.packed:
            n = linear.pack_linears(self.model, rows)
            log.info("linear layers: %d run on weights prepacked for oneDNN (tuned for %d rows)", n, rows)

    def _prime_rotary(self, max_len: int) -> None:
        """Fills FMS's rotary-frequency cache before compiling, so tracing never mutates it."""
        from fms.modules.positions import RotaryEmbedding

        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding):
                module.compute_freqs_cis(torch.device("cpu"), max(max_len, 2048))

    # ---- the compiled hot step -------------------------------------------------------------------

    def _forward(
        self,
        input_ids,
        position_ids,
        mask,
        slot_mapping,
        block_table=None,
        slab_start=None,
        seq_lens=None,
        mixed=False,
        piece_tables=None,
        piece_lens=None,
        token_piece=None,
        token_pos=None,
    ):
        # input_ids, position_ids, slot_mapping: [B, L]; mask: [B, L, K]; block_table: [B, nb] -> [B, V]
        # seq_lens [B]: a paged decode (block_table: the rows'); mixed: one row of a chunk region of T =
        # len(token_piece) tokens (pieces of up to P prompts, each piece's last token in the region's last P
        # places) and B decode tokens -> [P + B, V] (the pieces' last tokens, then the decode rows); T is
        # read off a tensor's shape, so with dynamic chunks it stays symbolic; see kv_cache.py
        kwargs = {"slot_mapping": slot_mapping}
        if mask is not None:
            kwargs["mask"] = mask
        if block_table is not None:
            kwargs["block_table"] = block_table
        if slab_start is not None:
            kwargs["slab_start"] = slab_start
        if seq_lens is not None:
            kwargs["seq_lens"] = seq_lens
            if self.config.backend == "sendnn":  # the card's compiler cannot call the opaque paged op
                kwargs["static_decode"] = True
        if mixed:
            kwargs.update(
                mixed=mixed,
                piece_tables=piece_tables,
                piece_lens=piece_lens,
                token_piece=token_piece,
                token_pos=token_pos,
            )
        last = input_ids.shape[1] - token_piece.shape[0] + piece_lens.shape[0] if mixed else 1
        logits, _ = self.model(
            input_ids,
            position_ids=position_ids,
            past_key_value_states=self.kv.layers,
            use_cache=True,
            last_n_tokens=last,
            attn_name=kv_cache.ATTN_NAME,
            **kwargs,
        )
        return logits[0] if mixed else logits[:, -1, :]

    def _run(self, *args, live_rows: int | None = None) -> torch.Tensor:
        """`live_rows`: a decode step whose first n rows only are live (linear.live_rows)."""
        if self.workers is not None:
            self.workers.send("run", (args, live_rows))
        return self.run_local(*args, live_rows=live_rows)

    def run_local(self, *args, live_rows: int | None = None) -> torch.Tensor:
        with torch.inference_mode(), linear.live_rows(live_rows), kv_cache.step_layouts():
            if self.is_warm and self.config.backend != "eager":
                with torch.compiler.set_stance("fail_on_recompile"):
                    return self._step_fn(*args)
            if self.config.dynamic_chunks and len(args) == 12:  # a mixed step, compiling
                self._mark_dynamic_chunk(*args)
            try:
                # freezing would make one group's weights constants of the graph every group shares;
                # where the weights are not packed (bf16 on an AVX2 CPU, fp16) oneDNN cannot pack them either
                freeze = not self.packed and self.blocks is None
                with compile_settings(
                    self.config.backend, self.config.cache_enabled, freeze, self._cache_tag()
                ):
                    return self._step_fn(*args)
            finally:
                if self.blocks is not None:
                    self.blocks.dynamic_tokens = None

    def _cache_tag(self) -> str:
        """The dynamic chunk range, for inductor's cache key (see _cache_tag_pass)."""
        if not self.config.dynamic_chunks:
            return ""
        low, high = self._chunk_range()
        return f"spyre-serve-chunks:{low}-{high}+{max(self.config.batch_buckets)}"

    def _chunk_range(self) -> tuple[int, int]:
        cfg = self.config
        return CHUNK_ALIGN + cfg.prefill_pieces, cfg.max_num_batched_tokens + cfg.prefill_pieces

    def _mark_dynamic_chunk(self, input_ids, position_ids, _mask, slot_mapping, *rest) -> None:
        """A mixed step's token dimension is dynamic (config.dynamic_chunks): the one graph compiled for it
        serves every chunk length from CHUNK_ALIGN to max_num_batched_tokens (a length outside that range
        would compile again, which serving refuses). Only the compiling call needs the marks."""
        *_, token_piece, token_pos = rest
        rows = max(self.config.batch_buckets)  # the decode tokens after the chunk region
        low, high = self._chunk_range()
        for t in (input_ids, position_ids, slot_mapping):
            torch._dynamo.mark_dynamic(t, 1, min=low + rows, max=high + rows)
        for t in (token_piece, token_pos):
            torch._dynamo.mark_dynamic(t, 0, min=low, max=high)
        if self.blocks is not None:  # the hidden states the blocks get: [1, chunk + rows, D]
            self.blocks.dynamic_tokens = (low + rows, high + rows)

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """[L] token ids -> [L, V] logits of every position: an eager pass with no KV cache and no compiled
        graph (prompt logprobs), run on every tensor-parallel rank."""
        if self.workers is not None:
            self.workers.send("score", token_ids)
        return self.score_local(token_ids)

    def score_local(self, token_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = self.model(torch.tensor([token_ids], dtype=torch.long), use_cache=False)
        return (logits[0] if isinstance(logits, tuple) else logits)[0]

    def set_env(self, values: dict[str, str]) -> None:
        """Sets environment variables here and on every tensor-parallel rank (before compiling)."""
        os.environ.update(values)
        if self.workers is not None:
            self.workers.send("env", values)

    def close(self) -> None:
        if self.workers is not None:
            self.workers.stop()

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

    def execute_static(self, step: StaticStep) -> SamplerOutput:
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
        return _sample(self._run(*args), reqs)

    # ---- continuous batching: paged, bucketed shapes ---------------------------------------------

    def chunk_inputs(self, chunk: PrefillChunk, kv_len: int):
        """One request's prefill chunk, left-padded to `chunk.chunk_size` rows so its last token comes
        last; it attends to the request's earlier tokens through its block table (K = kv_len keys)."""
        C, n, start = chunk.chunk_size, len(chunk.token_ids), chunk.start
        nb = kv_len // BLOCK_SIZE
        pad = C - n
        table = torch.full((1, nb), SCRATCH_BLOCK, dtype=torch.long)
        table[0, : len(chunk.block_table)] = torch.tensor(chunk.block_table, dtype=torch.long)
        logical = torch.arange(start, start + n)
        ids = torch.zeros(1, C, dtype=torch.long)
        pos = torch.zeros(1, C, dtype=torch.long)
        slots = torch.full((1, C), SCRATCH_BLOCK * BLOCK_SIZE, dtype=torch.long)
        ids[0, pad:] = torch.tensor(chunk.token_ids, dtype=torch.long)
        pos[0, pad:] = logical
        slots[0, pad:] = table[0, logical // BLOCK_SIZE] * BLOCK_SIZE + logical % BLOCK_SIZE
        mask = torch.zeros(1, C, kv_len, dtype=torch.bool)
        mask[0, :pad, 0] = True  # pad rows see one finite key; their outputs are dropped
        mask[0, pad:] = torch.arange(kv_len)[None, :] <= logical[:, None]
        return ids, pos, mask, slots, table

    def batch_decode_inputs(self, step: ContinuousStep):
        """[batch_size, 1] decode of every running request: each row's block table (padded with scratch to
        the longest sequence's) and its length; the paged op reads each row's live slots (kv_cache.py).
        Dummy rows write scratch and see one scratch slot. The step's KV bucket plays no part."""
        B = step.batch_size
        n = len(step.decode)
        ids = torch.zeros(B, 1, dtype=torch.long)
        pos = torch.zeros(B, 1, dtype=torch.long)
        slots = torch.full((B, 1), SCRATCH_BLOCK * BLOCK_SIZE, dtype=torch.long)
        table = torch.full((B, self.decode_table_width), SCRATCH_BLOCK, dtype=torch.long)
        seq_lens = torch.ones(B, dtype=torch.long)
        if n:
            for r, row in enumerate(step.decode):
                table[r, : len(row.block_table)] = torch.tensor(row.block_table, dtype=torch.long)
            position = torch.tensor([row.position for row in step.decode])
            ids[:n, 0] = torch.tensor([row.token_id for row in step.decode])
            pos[:n, 0] = position
            slots[:n, 0] = table[torch.arange(n), position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
            seq_lens[:n] = position + 1
        return ids, pos, None, slots, table, None, seq_lens

    def mixed_inputs(self, step: ContinuousStep):
        """One row: the chunk region, then `batch_size` decode tokens. The region holds the step's pieces
        (`step.chunks`, up to P = `config.prefill_pieces` prompts): every token of a piece but its last one
        in order from the start, padded to the step's chunk bucket C, then the last token of piece p at
        C + p (P places), so the pieces' next-token logits are the forward's last P + B rows with the decode
        rows'. Each piece attends to its own request's slots (kv_cache.paged_prefill); the decode tokens as
        in a decode step."""
        P, C = self.config.prefill_pieces, step.chunk_size
        T = C + P
        ids = torch.zeros(T, dtype=torch.long)
        pos = torch.zeros(T, dtype=torch.long)
        slots = torch.full((T,), SCRATCH_BLOCK * BLOCK_SIZE, dtype=torch.long)
        token_piece = torch.full((T,), -1, dtype=torch.long)
        piece_tables = torch.full((P, self.decode_table_width), SCRATCH_BLOCK, dtype=torch.long)
        piece_lens = torch.zeros(P, dtype=torch.long)
        body = 0
        for p, chunk in enumerate(step.chunks):
            n = len(chunk.token_ids)
            piece_tables[p, : len(chunk.block_table)] = torch.tensor(chunk.block_table, dtype=torch.long)
            piece_lens[p] = chunk.start + n
            where = torch.cat([torch.arange(body, body + n - 1), torch.tensor([C + p])])
            logical = torch.arange(chunk.start, chunk.start + n)
            ids[where] = torch.tensor(chunk.token_ids, dtype=torch.long)
            pos[where] = logical
            slots[where] = piece_tables[p, logical // BLOCK_SIZE] * BLOCK_SIZE + logical % BLOCK_SIZE
            token_piece[where] = p
            body += n - 1
        d_ids, d_pos, _, d_slots, d_table, _, seq_lens = self.batch_decode_inputs(step)
        return (
            torch.cat([ids, d_ids.view(-1)])[None],
            torch.cat([pos, d_pos.view(-1)])[None],
            None,
            torch.cat([slots, d_slots.view(-1)])[None],
            d_table,
            None,
            seq_lens,
            True,
            piece_tables,
            piece_lens,
            token_piece,
            pos,
        )

    def execute_continuous(self, step: ContinuousStep) -> SamplerOutput:
        if step.mixed:
            logits = self._run(*self.mixed_inputs(step))  # [the pieces' last tokens (P), decode rows]
            P = self.config.prefill_pieces
            ends = [p for p, chunk in enumerate(step.chunks) if chunk.is_last]
            logits = logits[[P + r for r in range(len(step.decode))] + ends]
        elif step.chunks:
            (chunk,) = step.chunks
            logits = self._run(*self.chunk_inputs(chunk, self.prefill_kv_len))
        else:
            logits = self._run(*self.batch_decode_inputs(step), live_rows=len(step.decode))
        # a chunk that does not end its prompt has no request: nothing is sampled for it
        return _sample(logits, step.requests)

    def execute(self, step: StaticStep | ContinuousStep) -> SamplerOutput:
        """Runs one step; returns one sampled token per request of `step.requests`."""
        if isinstance(step, ContinuousStep):
            return self.execute_continuous(step)
        return self.execute_static(step)

    # ---- warmup ----------------------------------------------------------------------------------

    def warmup(self) -> float:
        """Compiles and runs every graph serving can need: prefill and decode of every static shape, or
        every chunk bucket and (batch, KV length) decode bucket of continuous batching."""
        t_all = time.monotonic()
        cfg = self.config
        if cfg.skip_warmup:  # development only (the operator never sets it)
            log.warning("warm-up skipped (--skip-warmup): every shape compiles on first use, while serving")
            self.warmup_seconds = 0.0
            return 0.0
        graphs = 2 * len(cfg.shapes)
        if cfg.use_cb:
            graphs = (1 if cfg.dynamic_chunks else len(cfg.chunk_buckets)) + len(cfg.batch_buckets)
        self.progress.start(graphs)
        # The limits count every compiled entry of `_forward`'s code object in the process, earlier executors'
        # included (with frozen graphs they stay: a second executor's warmup hit a limit of 8), so a process
        # that builds several executors (tests) needs room beyond this one's graphs. Serving never compiles.
        with torch._dynamo.config.patch(
            recompile_limit=graphs + 1024, accumulated_recompile_limit=graphs + 4096
        ):
            if cfg.use_cb:
                self._warm_continuous()
            else:
                self._warm_static()
        self.warmup_seconds = time.monotonic() - t_all
        self.is_warm = True
        if self.workers is not None:
            self.workers.send("warm")
        log.info("Warmup finished in %.2f s", self.warmup_seconds)
        return self.warmup_seconds

    def _warm_static(self) -> None:
        for shape in self.config.shapes:
            t0 = time.monotonic()
            prompts = [[1] * shape.prompt_len] * shape.batch_size
            self._run(*self.prefill_inputs(shape, prompts))
            t1 = time.monotonic()
            what = f"batch_size:{shape.batch_size} seq_len:{shape.prompt_len}"
            self.progress.step("Prefill", what, t1 - t0)
            self._run(
                *self.decode_inputs(shape, [shape.prompt_len] * shape.batch_size, [1] * shape.batch_size, 0)
            )
            self.shape_seconds[shape] = time.monotonic() - t0
            self.progress.step("Decode", f"{what} new_tokens:{shape.new_tokens}", time.monotonic() - t1)
            log.info("Warmup of shape %s took %.2f s", shape, self.shape_seconds[shape])

    def _warm_continuous(self) -> None:
        """Dummy steps on the scratch block only: nothing a request owns is written."""
        cfg = self.config
        kv_max = self.prefill_kv_len
        rows = max(cfg.batch_buckets)
        t0 = time.monotonic()
        for i, size in enumerate(cfg.chunk_lengths):
            chunk = PrefillChunk(None, (1,) * size, 0, size, (SCRATCH_BLOCK,) * (kv_max // BLOCK_SIZE), True)
            if cfg.cp_interleave_steps:  # chunks run as mixed steps, beside the decode of `rows` requests
                step = ContinuousStep((chunk,), batch_size=rows, mixed=True)
                # dynamic chunks: one graph, compiled by the first length; the second must not compile
                again = cfg.dynamic_chunks and i > 0
                with torch.compiler.set_stance("fail_on_recompile") if again else contextlib.nullcontext():
                    self._run(*self.mixed_inputs(step))
                what = f"chunk:{size} pieces:{cfg.prefill_pieces} decode_rows:{rows} kv_len:{kv_max}"
            else:
                self._run(*self.chunk_inputs(chunk, kv_max))
                what = f"chunk:{size} kv_len:{kv_max}"
            if cfg.dynamic_chunks and i == 0:
                continue  # the same graph as the next length: one progress step for both
            self.progress.step("Prefill", what, time.monotonic() - t0)
            t0 = time.monotonic()
        for batch in cfg.batch_buckets:  # paged decode reads live slots: one graph per batch bucket
            t0 = time.monotonic()
            self._run(*self.batch_decode_inputs(ContinuousStep(batch_size=batch, kv_len=kv_max)))
            self.progress.step("Decode", f"batch_size:{batch} kv_len:{kv_max}", time.monotonic() - t0)


def _sample(logits: torch.Tensor, reqs) -> SamplerOutput:
    """One token (and its logprobs, when asked) per request from the first len(reqs) rows (the rest are
    padding rows)."""
    return sample(logits, reqs)
