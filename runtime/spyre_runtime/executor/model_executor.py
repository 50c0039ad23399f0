"""The executor: runs the scheduler's steps on one decoder (and, with tensor parallelism, on its ranks).

It makes no policy decisions: it receives a step description from the scheduler, builds fixed-shape
tensors (step_inputs.py), runs the compiled forward and samples one token per row. Around it: loading the
model (loader.py), how the forward is compiled (compiler.py) and the warm-up that compiles every graph before
serving (warmup.py). After warmup, serving runs under torch.compiler's "fail_on_recompile" stance: a step
that would compile raises instead of silently compiling.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from contextlib import nullcontext

import torch
from spyre_contract.environment import ContractError
from spyre_contract.memory import kv_cache_dtype_for

from spyre_runtime.config import RuntimeConfig, Shape
from spyre_runtime.executor import kv_cache, linear
from spyre_runtime.executor.compiler import (
    BlockCompiler,
    cache_tag,
    compile_settings,
    compile_step,
    compiler_for,
    mark_dynamic_chunk,
    mark_dynamic_decode,
)
from spyre_runtime.executor.families.rooms import family_of, load_model
from spyre_runtime.executor.kernels import paged_attention
from spyre_runtime.executor.kv_cache import KVCachePool, blocks_for
from spyre_runtime.executor.loader import TORCH_DTYPES, model_dims, pack_weights, prime_rotary, resolve_dtype
from spyre_runtime.executor.loader import configure_threads as configure_threads  # re-exported
from spyre_runtime.executor.step_inputs import StepInputs, TokenSpan
from spyre_runtime.executor.warmup import (
    WarmupProgress,
    graphs_to_warm,
    span_reuses,
    warm_continuous,
    warm_static,
)
from spyre_runtime.executor.workers import WorkerGroup
from spyre_runtime.sampling.sampler import SamplerOutput, sample
from spyre_runtime.steps import ContinuousStep, StaticStep

log = logging.getLogger(__name__)


def _kernel_dtypes(config: RuntimeConfig, model) -> tuple[torch.dtype | None, torch.dtype | None]:
    """The model's and its KV cache's dtypes, known before the weights load, so that the C++ kernels' first
    build compiles only their paths (paged_attention.start_build); None for a model handed in, and for a
    pairing the cache's allocation refuses below."""
    if model is not None:
        return None, None
    dtype = resolve_dtype(config.dtype, config.backend, config.model_dir)
    try:
        return dtype, _cache_dtype(config, dtype)
    except ContractError:
        return None, None


def _cache_dtype(config: RuntimeConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype under a model run in `dtype` (--kv-cache-dtype; kv_cache_dtype_for refuses a
    pairing the runtime does not run)."""
    model = str(dtype).removeprefix("torch.")
    return TORCH_DTYPES[kv_cache_dtype_for(config.backend, model, config.kv_cache_dtype)]


class ModelExecutor:
    """The decoder, its KV cache and its compiled step: `execute(step)` -> one sampled token per request."""

    def __init__(self, config: RuntimeConfig, model=None, compile_only: bool = False, rank: int = 0) -> None:
        """On rank 0 with --tensor-parallel-size N > 1 this spawns ranks 1..N-1, each building an executor of
        this class for its shard (see workers.py)."""
        self.config = config
        kv_cache.register()
        if config.backend != "sendnn":  # the CPU decode attention kernel builds while the weights load
            paged_attention.start_build(*_kernel_dtypes(config, model))
        tp = config.tensor_parallel_size > 1
        self.workers = WorkerGroup(config, type(self)) if tp and rank == 0 else None
        family = family_of(config.model_dir)  # the registry's record and its room (families/)
        self.model, self.dtype = load_model(config, model)
        self.model, self.vision = family.split_model(self.model, config.tensor_parallel_size)
        if tp:
            # every rank has loaded (and left its load slot) before rank 0 may take a slot to compile
            torch.distributed.barrier()
        self.dims = model_dims(self.model)
        self.packed = pack_weights(self.model, config, self.dtype)
        prime_rotary(self.model, max(config.max_model_len, max(s.max_len for s in config.shapes)))
        self.inputs = StepInputs(config)
        if config.use_cb:
            num_blocks = config.cb_num_blocks
        else:
            num_blocks = 1 + max(s.batch_size * blocks_for(s.max_len) for s in config.shapes)
        # --kv-cache-dtype: the cache may be narrower than the model (kv_cache._store narrows, readers widen)
        kv_dtype = self.dtype
        if config.kv_cache_dtype != "auto":  # refused here too for callers that skip config.check_memory
            kv_dtype = _cache_dtype(config, self.dtype)
        self.kv = KVCachePool(
            self.dims.num_layers, num_blocks, self.dims.kv_heads, self.dims.head_dim, dtype=kv_dtype
        )
        self.mamba = family.attach_state(self.model, config, self.dtype)  # a hybrid model's state slots
        self.cache_states = self.mamba.cache_states(self.kv.layers) if self.mamba else self.kv.layers
        self.blocks = None
        if config.backend == "inductor" and self.mamba is None:  # hybrid: the whole forward in one graph
            self.blocks = BlockCompiler(self.model, compiler_for(config.backend), self.kv.layers)
            self._step_fn = self._forward
        else:
            self._step_fn = compile_step(self._forward, config.backend, compile_only)
        # the decode buckets that share one graph (its block groups' marks; the whole forward in one graph
        # keeps a graph per bucket)
        self.decode_span = config.dynamic_decode if self.blocks is not None else None
        self._warm = False
        self.warmup_seconds: float | None = None
        self.shape_seconds: dict[Shape, float] = {}
        self.progress = WarmupProgress()  # graphs warmed so far, for the log, /health and a gauge

    @property
    def is_warm(self) -> bool:
        return self._warm

    @is_warm.setter
    def is_warm(self, warm: bool) -> None:
        """Warm (every graph compiled; a tensor-parallel rank is told so): the block groups but a step's first
        skip dynamo's guard checks, if warm-up found that they may (compiler.BlockCompiler)."""
        self._warm = warm
        if warm and self.blocks is not None:
            direct = self.blocks.serve_direct()
            log.info("a step's later block groups %s", "skip dynamo" if direct else "go through dynamo")

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
            past_key_value_states=self.cache_states,
            use_cache=True,
            last_n_tokens=last,
            attn_name=kv_cache.ATTN_NAME,
            **kwargs,
        )
        return logits[0] if mixed else logits[:, -1, :]

    def _run(
        self,
        *args,
        live_rows: int | tuple | None = None,
        spans: tuple[TokenSpan, ...] = (),
        here_only: bool = False,
    ) -> torch.Tensor:
        """`live_rows`: a decode step whose first n rows only are live (linear.live_rows). An image-text
        model's language model takes embeddings, with image features at the image tokens of `spans`.
        `here_only`: this rank alone, for warm-up's retry of a step the other ranks were sent once
        (warmup.run_step)."""
        if self.vision is not None:
            args = (self.vision.embed(args[0], spans), *args[1:])
        if self.workers is not None and not here_only:
            self.workers.send("run", (args, live_rows))
        return self.run_local(*args, live_rows=live_rows)

    _run_here = functools.partialmethod(_run, here_only=True)  # warm-up's retry on this rank alone

    def run_local(self, *args, live_rows: int | tuple | None = None) -> torch.Tensor:
        live = live_rows if isinstance(live_rows, tuple) else (live_rows,)
        with torch.inference_mode(), linear.live_rows(*live), kv_cache.step_layouts():
            if self.is_warm and self.config.backend != "eager":
                with torch.compiler.set_stance("fail_on_recompile"):
                    return self._step_fn(*args)
            # eager, or compiling (warm-up): a mixed step's token dimension may be dynamic (compiler.py)
            if self.config.dynamic_chunks and len(args) == 12:
                mark_dynamic_chunk(self.config, self.blocks, *args)
            elif self.decode_span is not None and len(args) == 7:
                mark_dynamic_decode(self.decode_span, self.blocks, *args)
            try:
                # freezing would make one group's weights constants of the graph every group shares;
                # where the layers are not routed (float16) oneDNN cannot pack their weights either
                freeze = not self.packed and self.blocks is None
                with compile_settings(
                    self.config.backend, self.config.cache_enabled, freeze, cache_tag(self.config)
                ):
                    return self._step_fn(*args)
            finally:
                if self.blocks is not None:
                    self.blocks.dynamic_tokens = self.blocks.dynamic_batch = None

    # ---- steps -----------------------------------------------------------------------------------

    def execute_static(self, step: StaticStep) -> SamplerOutput:
        """Runs one step; returns one sampled token per request of the step (dummy rows dropped)."""
        reqs = step.requests
        if step.is_prefill:
            args = self.inputs.static_prefill(step.shape, [r.prompt_token_ids for r in reqs])
        else:
            args = self.inputs.static_decode(
                step.shape,
                [r.num_prompt_tokens for r in reqs],
                [r.output_token_ids[-1] for r in reqs],
                step.decode_index,
            )
        return sample(self._run(*args, spans=self.inputs.spans(step)), reqs)

    def execute_continuous(self, step: ContinuousStep) -> SamplerOutput:
        if step.mixed:
            # [the pieces' last tokens (P), decode rows]
            args = self.inputs.mixed(step)
            logits = self._run(*args, live_rows=mixed_live_rows(args[0], step), spans=self.inputs.spans(step))
            P = self.config.prefill_pieces
            ends = [p for p, chunk in enumerate(step.chunks) if chunk.is_last]
            logits = logits[[P + r for r in range(len(step.decode))] + ends]
        elif step.chunks:
            (chunk,) = step.chunks
            args = self.inputs.chunk(chunk, self.inputs.prefill_kv_len)
            logits = self._run(*args, spans=self.inputs.spans(step))
        else:
            logits = self._run(*self.inputs.batch_decode(step), live_rows=len(step.decode))
        # a chunk that does not end its prompt has no request: nothing is sampled for it; a row before an
        # n-gram draft of its request draws with that draft (speculative sampling)
        after = (*step.decode[1:], None)
        drafts = [row.token_id if row is not None and row.draft else None for row in after]
        return sample(logits, step.requests, drafts)

    def execute(self, step: StaticStep | ContinuousStep) -> SamplerOutput:
        """Runs one step; returns one sampled token (and its logprobs, when asked) per request of
        `step.requests`, from the first rows of the logits (the rest are padding rows)."""
        state = (
            self.mamba.step_context(step, self.config.prefill_pieces)
            if self.mamba is not None
            else nullcontext()
        )
        with state:
            if isinstance(step, ContinuousStep):
                return self.execute_continuous(step)
            return self.execute_static(step)

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

    # ---- warmup ----------------------------------------------------------------------------------

    def warmup(self) -> float:
        """Compiles and runs every graph serving can need: prefill and decode of every static shape, or
        every chunk bucket and (batch, KV length) decode bucket of continuous batching (warmup.py)."""
        t_all = time.monotonic()
        cfg = self.config
        if cfg.skip_warmup:  # development only (the operator never sets it)
            log.warning("warm-up skipped (--skip-warmup): every shape compiles on first use, while serving")
            self.warmup_seconds = 0.0
            return 0.0
        graphs = graphs_to_warm(cfg)
        self.progress.start(graphs, graphs - span_reuses(cfg, self.decode_span))
        # The limits count every compiled entry of `_forward`'s code object in the process, earlier executors'
        # included (with frozen graphs they stay: a second executor's warmup hit a limit of 8), so a process
        # that builds several executors (tests) needs room beyond this one's graphs. Serving never compiles.
        with torch._dynamo.config.patch(
            recompile_limit=graphs + 1024, accumulated_recompile_limit=graphs + 4096
        ):
            if cfg.use_cb:
                warm_continuous(self._run, self.inputs, cfg, self.progress, self.decode_span, self._run_here)
            else:
                self.shape_seconds.update(warm_static(self._run, self.inputs, cfg.shapes, self.progress))
        self.warmup_seconds = time.monotonic() - t_all
        self.is_warm = True
        if self.workers is not None:
            self.workers.send("warm")
        log.info("Warmup finished in %.2f s", self.warmup_seconds)
        return self.warmup_seconds


def mixed_live_rows(input_ids: torch.Tensor, step: ContinuousStep) -> tuple[int, int, dict]:
    """A mixed step's live rows (linear.live_rows): its live tokens, its live decode rows, and the live spans
    of the body's T + B rows (the chunk with the used piece places, then the live decode tokens) and of the
    LM head's last P + B rows (the used places, the live decode rows). Its graph's decode rows are the
    largest batch bucket's; the dead ones are its last tokens, the unused piece places lie between."""
    total = input_ids.shape[1]
    P, B, k, d = step.pieces, step.batch_size, len(step.chunks), len(step.decode)
    T = total - B  # the chunk region: C + P
    spans = {total: ((0, T - P + k), (T, T + d)), P + B: ((0, k), (P, P + d))}
    return T + d, d, spans
