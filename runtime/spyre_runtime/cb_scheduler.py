"""The continuous-batching scheduler: requests join and leave a running decode batch. No tensors.

Same contract as the static scheduler: `step = schedule()`; the executor runs it; the engine appends the
sampled tokens; `update(step)` returns the requests that finished and left.

    waiting ──admit (blocks allocated, prefix hits counted as computed)──► prefilling (one at a time)
       ▲                                                                      │ chunk by chunk
       │ preempted (blocks freed, re-prefilled later: prompt + output so far)  ▼
       └───────────────────────────────────────────────────────────────── running ──finished──► freed

A step is a decode of every running request, a prefill chunk of one request, or both at once:
- Chunks hold at most `max_num_batched_tokens` tokens and run at the smallest chunk bucket that fits.
- Prefills are not held back: a waiting request is admitted as soon as a sequence slot and blocks are free,
  so the decode batch fills up. With `interleave` (SENDNN_INFERENCE_CP_INTERLEAVE_STEPS=1, the default) a
  chunk and the decode of every running request run as one mixed step (vLLM's chunked prefill): the running
  requests keep streaming while a prompt arrives, and the decode rows ride through the chunk's GEMMs instead
  of reading the weights again. Without it, all chunks of a prompt run alone, back to back.
- A decode step runs at the smallest (batch, KV length) bucket holding every running request; a mixed step
  at the largest batch bucket (one graph per chunk bucket).
Invariants: at most `max_num_seqs` requests hold blocks; prompt + max_tokens <= max_model_len for every
admitted request, and the pool holds one such sequence, so the oldest running request always progresses.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

from spyre_runtime.block_manager import BlockManager
from spyre_runtime.config import RuntimeConfig
from spyre_runtime.request import Request, Status
from spyre_runtime.scheduler import abort_waiting, check_admissible


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens [start, start + len(token_ids)) of the request's sequence, run at `chunk_size` rows."""

    request: Request
    token_ids: tuple[int, ...]
    start: int
    chunk_size: int
    block_table: tuple[int, ...]
    is_last: bool  # the chunk ends the sequence: its sampled token is the request's next token


@dataclass(frozen=True)
class DecodeRow:
    request: Request
    token_id: int
    position: int
    block_table: tuple[int, ...]


@dataclass(frozen=True)
class ContinuousStep:
    prefill: PrefillChunk | None = None
    decode: tuple[DecodeRow, ...] = ()
    batch_size: int = 1  # decode bucket
    kv_len: int = 0  # decode bucket

    mixed: bool = False  # the chunk and the decode rows run as one forward

    @property
    def is_prefill(self) -> bool:
        return self.prefill is not None

    @property
    def requests(self) -> tuple[Request, ...]:
        """The requests that receive a sampled token from this step, in row order: the decode rows, then
        the prefilled request when its chunk ends its prompt."""
        done = (self.prefill.request,) if self.prefill is not None and self.prefill.is_last else ()
        return tuple(row.request for row in self.decode) + done

    @property
    def scheduled(self) -> tuple[Request, ...]:
        """Requests whose prompt this step computes (their scheduled time is the first such step)."""
        return (self.prefill.request,) if self.prefill is not None else ()

    @property
    def occupancy(self) -> float:
        """Live tokens / tokens the step's graph computes."""
        chunk = (len(self.prefill.token_ids), self.prefill.chunk_size) if self.prefill is not None else (0, 0)
        decode = (
            (len(self.decode), self.batch_size) if self.decode or self.mixed or not self.prefill else (0, 0)
        )
        return (chunk[0] + decode[0]) / max(1, chunk[1] + decode[1])

    @property
    def num_tokens(self) -> int:
        return (len(self.prefill.token_ids) if self.prefill is not None else 0) + len(self.decode)


def smallest_bucket(buckets: tuple[int, ...], n: int) -> int:
    return min(b for b in buckets if b >= n)


class ContinuousScheduler:
    def __init__(self, config: RuntimeConfig) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.chunk_tokens = config.max_num_batched_tokens
        self.chunk_buckets = config.chunk_buckets
        self.batch_buckets = config.batch_buckets
        self.kv_buckets = config.kv_buckets
        self.interleave = config.cp_interleave_steps
        self.blocks = BlockManager(config.cb_num_blocks, enable_prefix_caching=config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.prefilling: Request | None = None
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache, in all

    # ---- queue -----------------------------------------------------------------------------------

    def can_admit(self, num_prompt_tokens: int, max_tokens: int) -> bool:
        return num_prompt_tokens >= 1 and num_prompt_tokens + max_tokens <= self.max_model_len

    def max_tokens_for(self, num_prompt_tokens: int) -> int:
        """The largest max_tokens a prompt of this length can ask for (0: the prompt itself is too long)."""
        return max(0, self.max_model_len - num_prompt_tokens)

    def describe_limits(self) -> str:
        return (
            "exceeds the maximum model length: prompt tokens + max_tokens must be at most "
            f"{self.max_model_len}"
        )

    def add(self, request: Request) -> None:
        check_admissible(self, request)
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Removes the request wherever it is and frees its blocks at once."""
        req = abort_waiting(self.waiting, request_id)
        if req is not None:
            return req
        holders = [self.prefilling] if self.prefilling is not None else []
        for req in holders + self.running:
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
        return len(self.running) + (self.prefilling is not None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    # ---- steps -----------------------------------------------------------------------------------

    def schedule(self) -> ContinuousStep | None:
        if self.interleave:
            return self._mixed_step()
        return self._prefill_step() or self._decode_step() or self._prefill_step()
        # (the last: every decoder was preempted)

    def _mixed_step(self) -> ContinuousStep | None:
        """The decode of every running request and the next chunk of the prompt being prefilled, as one
        step. The decode rows take their blocks first (a preemption may end the prefill: its request is
        then the first to be admitted again)."""
        decode = self._decode_step()
        if self.prefilling is None:
            self._admit()
        if self.prefilling is None:
            return decode
        chunk = self._next_chunk(self.prefilling)
        if decode is None:
            return ContinuousStep(prefill=chunk, batch_size=max(self.batch_buckets), mixed=True)
        return dataclasses.replace(decode, prefill=chunk, batch_size=max(self.batch_buckets), mixed=True)

    def _prefill_step(self) -> ContinuousStep | None:
        if self.prefilling is None:
            self._admit()
        if self.prefilling is None:
            return None
        return ContinuousStep(prefill=self._next_chunk(self.prefilling))

    def _admit(self) -> None:
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return
        req = self.waiting[0]
        tokens = req.all_token_ids()
        # room for the sequence and its first decode token, so admitting never forces a preemption
        if not self.blocks.can_allocate([*tokens, 0]):
            return
        self.waiting.popleft()
        allocation = self.blocks.allocate(req.request_id, tokens)
        req.num_computed_tokens = allocation.num_cached_tokens
        self.num_cached_tokens += allocation.num_cached_tokens
        req.status = Status.RUNNING
        self.prefilling = req

    def _next_chunk(self, req: Request) -> PrefillChunk:
        tokens = req.all_token_ids()
        start = req.num_computed_tokens
        chunk = tokens[start : start + self.chunk_tokens]
        return PrefillChunk(
            request=req,
            token_ids=tuple(chunk),
            start=start,
            chunk_size=smallest_bucket(self.chunk_buckets, len(chunk)),
            block_table=self.blocks.block_table(req.request_id),
            is_last=start + len(chunk) == len(tokens),
        )

    def _decode_step(self) -> ContinuousStep | None:
        for req in list(self.running):
            if req not in self.running:  # preempted while making room for an older request
                continue
            while not self.blocks.can_append(req.request_id, req.num_tokens):
                victim = self.prefilling if self.prefilling is not None else self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            else:
                self.blocks.append(req.request_id, req.num_tokens)
        if not self.running:
            return None
        rows = tuple(
            DecodeRow(r, r.output_token_ids[-1], r.num_tokens - 1, self.blocks.block_table(r.request_id))
            for r in self.running
        )
        return ContinuousStep(
            decode=rows,
            batch_size=smallest_bucket(self.batch_buckets, len(rows)),
            kv_len=smallest_bucket(self.kv_buckets, max(r.num_tokens for r in self.running)),
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
        if req is self.prefilling:
            self.prefilling = None
        else:
            self.running.remove(req)

    def update(self, step: ContinuousStep) -> list[Request]:
        """Called after the engine appended this step's tokens. Returns the requests that finished."""
        done = []
        if step.prefill is not None:
            req = step.prefill.request
            req.num_computed_tokens = step.prefill.start + len(step.prefill.token_ids)
            self.blocks.commit(req.request_id, req.num_computed_tokens)
            if step.prefill.is_last:
                self.prefilling = None
                self.running.append(req)
        for row in step.decode:
            row.request.num_computed_tokens = row.position + 1
        for req in step.requests:
            if req.is_finished and req in self.running:
                self._release(req)
                done.append(req)
        return done
