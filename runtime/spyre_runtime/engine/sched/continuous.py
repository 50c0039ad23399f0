"""The continuous-batching scheduler: requests join and leave a running decode batch. No tensors.

Same contract as the static scheduler: `step = schedule()`; the executor runs it; the engine appends the
sampled tokens; `update(step)` returns the requests that finished and left.

    waiting ──admit (blocks allocated, prefix hits counted as computed)──► prefilling (admission order)
       ▲                                                                      │ chunk by chunk
       │ preempted (blocks freed, re-prefilled later: prompt + output so far)  ▼
       └───────────────────────────────────────────────────────────────── running ──finished──► freed

A step is a decode of every running request, prefill chunks, or both at once:
- Prefills are not held back: waiting requests are admitted as soon as sequence slots and blocks are free,
  so the decode batch fills up.
- With `interleave` (SENDNN_INFERENCE_CP_INTERLEAVE_STEPS=1, the default) the decode of every running request
  and a chunk made of pieces of up to `prefill_pieces` prompts (in admission order, the first one's next
  tokens first, then the next prompt's while tokens are left) run as one mixed step, as vLLM's chunked
  prefill does: the running requests keep streaming while prompts arrive, the decode rows ride through the
  chunk's GEMMs instead of reading the weights again, and a step's token budget
  (`max_num_batched_tokens`) is spent on as many prompts as it holds instead of padding one prompt's last
  piece. Every piece's tokens but its last one make the chunk (the last ones go to `prefill_pieces` places
  of their own, see the executor), which runs at its own length rounded up to 8 tokens on CPU backends (one
  graph with a dynamic token dimension, `config.dynamic_chunks`) or at the smallest chunk bucket that holds
  it (sendnn: one graph per bucket); a mixed step runs at the largest batch bucket (its dead decode rows
  skipped, see the executor). Decode first, when set (SENDNN_INFERENCE_CB_MIXED_PREFILL_TOKENS; off by
  default): while requests are decoding, a step carries at most `mixed_prefill_tokens` prompt tokens, so a
  running stream's gap between two tokens stays near a decode step's length when prompts arrive; with
  nothing decoding a step carries the whole chunk. Waves kept whole (SENDNN_INFERENCE_CB_STEP_BUDGET_MS, off
  by default): a step's prompt tokens by a time budget, a wave's prompts finishing together (waves.py).
- Without it, a prompt's chunks (at most `max_num_batched_tokens` tokens, the smallest bucket that fits) run
  alone, back to back, one prompt at a time.
- A decode step runs at the smallest (batch, KV length) bucket holding every running request.
Invariants: at most `max_num_seqs` requests hold blocks; prompt + max_tokens <= max_model_len for every
admitted request, and the pool holds one such sequence, so the oldest running request always progresses.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from spyre_contract.environment import round_up

from spyre_runtime.config import CHUNK_ALIGN, RuntimeConfig
from spyre_runtime.engine.block_manager import BlockManager, window_for
from spyre_runtime.engine.sched.admission import abort_waiting, check_admissible
from spyre_runtime.engine.sched.interface import GenerateScheduler
from spyre_runtime.engine.sched.speculation import Speculation
from spyre_runtime.engine.sched.volume import Volumetric, fits_alone
from spyre_runtime.engine.sched.wave_start import WaveStart
from spyre_runtime.engine.state_slots import StateSlots
from spyre_runtime.request import Request, Status
from spyre_runtime.steps import ContinuousStep, DecodeRow, PrefillChunk


def smallest_bucket(buckets: tuple[int, ...], n: int) -> int:
    return min(b for b in buckets if b >= n)


class ContinuousScheduler(WaveStart, Volumetric, Speculation, GenerateScheduler[ContinuousStep]):
    def __init__(self, config: RuntimeConfig) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.chunk_buckets = config.chunk_buckets
        self.dynamic_chunks = config.dynamic_chunks
        self.chunk_tokens = config.max_num_batched_tokens
        if not self.dynamic_chunks:
            self.chunk_tokens = min(self.chunk_tokens, max(self.chunk_buckets))
        self.batch_buckets = config.batch_buckets
        self.kv_buckets = config.kv_buckets
        self.interleave = config.cp_interleave_steps
        self.pieces = config.prefill_pieces
        # the prompt tokens a mixed step carries while requests are decoding: a decode row's gap between two
        # tokens is the step's length, so this bounds a running stream's stall (ITL) when a prompt arrives
        self.mixed_budget = min(self.chunk_tokens, config.mixed_prefill_tokens or self.chunk_tokens)
        self.blocks = BlockManager(
            config.cb_num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            record_events=config.kv_events.is_enabled,
            window=window_for(config.model_dir),  # a sliding window frees the blocks left behind it
        )
        self.slots = StateSlots(1 + self.max_num_seqs)  # a hybrid model's Mamba state, one per sequence
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prompt not yet computed, in admission order
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache, in all
        # vLLM's prefix-cache counters: tokens looked up and found, of requests admitted for the first time
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        # Spyre's volumetric limit (engine/sched/volume.py): rows x context of a decode step, and pausing
        self.tkv_limit = config.max_batch_tkv_limit
        self.pausing = config.pausing_enabled
        self.long_output_first = config.long_output_priority
        self.paused: list[Request] = []  # decoding requests that sit out steps, keeping their blocks
        self.wave_start = config.wave_start  # a wave's prompts start decoding together (wave_start.py)
        self.held: dict[Request, float | frozenset[str]] = {}  # prefilled: its wave's ids (wave_start.py)
        self.admitted: dict[Request, None] = {}  # requests holding blocks, in admission order
        self.spec_tokens = config.ngram_spec_tokens  # a request's drafts a step (speculation.py; 0: off)
        self.num_draft_tokens = 0
        self.steps_paused: dict[str, int] = {}
        self.num_pause_events = 0
        self.num_resume_events = 0

    # ---- queue -----------------------------------------------------------------------------------

    def can_admit(self, num_prompt_tokens: int, max_tokens: int) -> bool:
        return (
            num_prompt_tokens >= 1
            and num_prompt_tokens + max_tokens <= self.max_model_len
            and fits_alone(num_prompt_tokens, max_tokens, self.tkv_limit)
        )

    def max_tokens_for(self, num_prompt_tokens: int) -> int:
        """The largest max_tokens a prompt of this length can ask for (0: the prompt itself is too long)."""
        return max(0, self.max_model_len - num_prompt_tokens)

    def describe_limits(self) -> str:
        limits = f"prompt tokens + max_tokens must be at most {self.max_model_len}"
        if self.tkv_limit:
            limits += (
                f", and rounded up to a 64-token block at most VLLM_DT_MAX_BATCH_TKV_LIMIT={self.tkv_limit} "
                "(a decode step's rows x context)"
            )
        return f"exceeds the maximum model length: {limits}"

    def add(self, request: Request) -> None:
        check_admissible(self, request)
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Removes the request wherever it is and frees its blocks at once."""
        req = abort_waiting(self.waiting, request_id)
        if req is not None:
            return req
        for req in [*self.prefilling, *self.running, *self.paused, *self.held]:
            if req.request_id == request_id:
                self._release(req)
                req.finish("abort")
                return req
        return None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling) + len(self.paused) + len(self.held)

    @property
    def num_paused(self) -> int:
        return len(self.paused)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling or self.paused or self.held)

    @property
    def kv_cache_usage(self) -> float:
        """Blocks held by sequences over the blocks of the pool (cached but free blocks count as free)."""
        return self.blocks.num_used_blocks / self.blocks.num_pool_blocks

    def take_kv_events(self) -> list:
        return self.blocks.take_events()

    # ---- steps -----------------------------------------------------------------------------------

    def schedule(self) -> ContinuousStep | None:
        if self.interleave:
            return self._mixed_step()
        return self._prefill_step() or self._decode_step() or self._prefill_step()
        # (the last: every decoder was preempted)

    def _mixed_step(self) -> ContinuousStep | None:
        """The decode of every running request and the next pieces of the prompts being prefilled, as one
        step. The decode rows take their blocks first (a preemption may end a prefill: its request is then
        the first to be admitted again)."""
        decode = self._decode_step()
        self._admit(self.max_num_seqs)
        if not self.prefilling:
            return decode
        chunks = self._pieces(len(decode.decode) if decode else 0)
        mixed = {
            "chunks": chunks,
            "batch_size": max(self.batch_buckets),
            "mixed": True,
            "pieces": self.pieces,
        }
        return dataclasses.replace(decode or ContinuousStep(), **mixed)

    def _prefill_step(self) -> ContinuousStep | None:
        self._admit(1)
        if not self.prefilling:
            return None
        req = self.prefilling[0]
        n = min(self.chunk_tokens, req.num_tokens - req.num_computed_tokens)
        return ContinuousStep((self._chunk(req, n, smallest_bucket(self.chunk_buckets, n)),))

    def _admit(self, limit: int) -> None:
        """Admits waiting requests in order while sequence slots and blocks are free and fewer than `limit`
        are prefilling."""
        while self.waiting and len(self.prefilling) < limit and self._admissible(self.waiting[0]):
            req = self.waiting.popleft()
            tokens = req.all_token_ids()
            allocation = self.blocks.allocate(req.request_id, tokens, req.cache_salt)
            req.num_computed_tokens = allocation.num_cached_tokens
            req.state_slot = self.slots.allocate(req.request_id)
            self.num_cached_tokens += allocation.num_cached_tokens
            if self.blocks.enable_prefix_caching and req.num_preemptions == 0:
                req.num_cached_tokens = allocation.num_cached_tokens
                self.num_prefix_queries += len(tokens)
                self.num_prefix_hits += allocation.num_cached_tokens
            req.status = Status.RUNNING
            self.prefilling.append(req)
            self.admitted[req] = None

    def _admissible(self, req: Request) -> bool:
        """A sequence slot is free, the volumetric limit admits it, and the blocks hold the sequence and its
        first decode token (so admitting never forces a preemption)."""
        return (
            self.num_running < self.max_num_seqs
            and self._volume_admits(req)
            and self.blocks.can_allocate([*req.all_token_ids(), 0], req.cache_salt)
        )

    def _pieces(self, rows: int) -> tuple[PrefillChunk, ...]:
        """A mixed step's prompt pieces beside `rows` decode rows (waves.py's policy overrides this)."""
        return self._next_pieces(self.mixed_budget if rows else self.chunk_tokens)

    def _next_pieces(self, budget: int) -> tuple[PrefillChunk, ...]:
        """Up to `pieces` prompts' next tokens, in admission order, within the step's token budget: the whole
        chunk when nothing decodes, `mixed_budget` beside decode rows."""
        sizes = []
        for req in self.prefilling[: self.pieces]:
            n = min(budget, req.num_tokens - req.num_computed_tokens)
            if n == 0:
                break
            sizes.append((req, n))
            budget -= n
        # every piece's last token has a place of its own beside the chunk
        body = sum(n - 1 for _, n in sizes)
        if self.dynamic_chunks:
            bucket = max(CHUNK_ALIGN, round_up(body, CHUNK_ALIGN))
        else:
            bucket = smallest_bucket(self.chunk_buckets, body)
        return tuple(self._chunk(req, n, bucket) for req, n in sizes)

    def _chunk(self, req: Request, n: int, bucket: int) -> PrefillChunk:
        tokens = req.all_token_ids()
        start = req.num_computed_tokens
        return PrefillChunk(
            request=req,
            token_ids=tuple(tokens[start : start + n]),
            start=start,
            chunk_size=bucket,
            block_table=self.blocks.block_table(req.request_id),
            is_last=start + n == len(tokens),
        )

    def _decode_step(self) -> ContinuousStep | None:
        self._start_waves()
        self._pause_over_the_limit()
        for req in list(self.running):
            if req not in self.running:  # preempted while making room for an older request
                continue
            self.blocks.free_outside_window(req.request_id, req.num_tokens - 1)
            while not self.blocks.can_append(req.request_id, req.num_tokens):
                victim = self.prefilling[-1] if self.prefilling else self._newest_started()
                self._preempt(victim)
                if victim is req:
                    break
            else:
                self.blocks.append(req.request_id, req.num_tokens)
        if not self.running:
            return None
        rows = self._speculate(
            tuple(
                DecodeRow(r, r.output_token_ids[-1], r.num_tokens - 1, self.blocks.block_table(r.request_id))
                for r in self.running
            )
        )
        return ContinuousStep(
            decode=rows,
            batch_size=smallest_bucket(self.batch_buckets, len(rows)),
            kv_len=smallest_bucket(self.kv_buckets, max(row.position + 1 for row in rows)),
        )

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self.blocks.free(req.request_id)
        self.slots.free(req.request_id)
        req.state_slot = 0
        self.steps_paused.pop(req.request_id, None)
        self.admitted.pop(req, None)
        if req in self.prefilling:
            self.prefilling.remove(req)
        elif req in self.held:
            del self.held[req]
        elif req in self.paused:
            self.paused.remove(req)
        else:
            self.running.remove(req)

    def update(self, step: ContinuousStep) -> list[Request]:
        """Called after the engine appended this step's tokens. Returns the requests that finished."""
        done, prefilled = [], []
        for chunk in step.chunks:
            req = chunk.request
            req.num_computed_tokens = chunk.start + len(chunk.token_ids)
            self.blocks.commit(req.request_id, req.num_computed_tokens)
            if chunk.is_last:
                self.prefilling.remove(req)
                prefilled.append(req)
        self._hold_for_wave(prefilled)
        for row in step.decode:  # every token but the last has its KV (a rejected draft's is written again)
            row.request.num_computed_tokens = row.request.num_tokens - 1
        for req in step.requests:
            if req.is_finished and req in self.running:
                self._release(req)
                done.append(req)
        for req in {row.request for row in step.decode if row.draft}:  # rejected drafts' blocks go back
            if req in self.running:
                self.blocks.truncate(req.request_id, req.num_tokens)
        return done
