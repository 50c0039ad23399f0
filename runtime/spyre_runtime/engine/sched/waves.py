"""Waves kept whole: the continuous scheduler's step-time policy (SENDNN_INFERENCE_CB_STEP_BUDGET_MS). No
tensors.

A wave is the prompts that arrive together (a client's fixed concurrency refills its streams at once). With
a token count per step, a wave larger than one step is split first come, first served: its first prompts
finish and decode while the rest still prefill, the two halves finish a step apart, their successors arrive
a step apart, and from then on every wave's prefill stalls the other half's decode (bench/README.md run 20b:
vLLM-client ITL p99 3.65x vLLM's, 1.78x once a wave fitted one step). With the policy on:

- a step's prompt tokens are what its time budget holds, by a linear cost model of a step
  (`StepCost`: fixed + per chunk token + per decode row, SENDNN_INFERENCE_CB_STEP_COST_US), so a running
  stream waits at most the budget for its next token however many rows decode beside the chunk; with
  nothing decoding the step takes the whole chunk (no stream waits on it but the wave's own);
- a window of prompts (the first `prefill_pieces` being prefilled) that does not fit one step finishes
  together: no prompt of the window gets its last token until all of them do (`wave_pieces`), so the wave
  starts decoding in one step and its streams stay in step. Held back is one token per prompt (its last,
  which takes a place of its own beside the chunk), so the wave needs no extra step; the price is the
  window's first prompts' TTFT, which becomes the window's last one's.

The compiled limits still hold: at most `--max-num-batched-tokens` (or the largest chunk bucket) prompt
tokens, `prefill_pieces` prompts, `max_num_seqs` sequences and the volumetric limit (admission is
unchanged). The smallest chunk always runs, so a prompt progresses even when the decode rows alone fill
the budget. Off (0) is the token-count scheduler unchanged: the factory picks `WaveScheduler` only when
the budget is set. Without mixed steps (SENDNN_INFERENCE_CP_INTERLEAVE_STEPS=0) nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spyre_contract.environment import round_up

from spyre_runtime.config import CHUNK_ALIGN, RuntimeConfig
from spyre_runtime.engine.sched.continuous import ContinuousScheduler
from spyre_runtime.steps import PrefillChunk


@dataclass(frozen=True)
class StepCost:
    """A step's time, linear in its work: `fixed_us` + `token_us` per chunk token (the chunk's padded
    length) + `row_us` per decode row."""

    fixed_us: int
    token_us: int
    row_us: int

    def of(self, chunk_size: int, rows: int) -> float:
        """The estimated time of a step, in ms."""
        return (self.fixed_us + self.token_us * chunk_size + self.row_us * rows) / 1000

    def tokens_within(self, budget_ms: int, rows: int) -> int:
        """The chunk tokens a step with `rows` decode rows can carry within `budget_ms` (0: none)."""
        left = budget_ms * 1000 - self.fixed_us - self.row_us * rows
        if left <= 0:
            return 0
        return left // self.token_us if self.token_us else 1 << 30


def chunk_limit(tokens: int, buckets: Sequence[int], dynamic: bool) -> int:
    """The longest chunk (its padded length) of at most `tokens`: a multiple of CHUNK_ALIGN with dynamic
    chunks, else a chunk bucket; the smallest one when none fits (a prompt always progresses)."""
    if dynamic:
        return max(CHUNK_ALIGN, tokens - tokens % CHUNK_ALIGN)
    return max((b for b in buckets if b <= tokens), default=min(buckets))


def wave_pieces(remaining: Sequence[int], body: int) -> list[int]:
    """The tokens each prompt of the window (`remaining` prompt tokens each, in admission order) computes
    this step, when every piece's tokens but its last one go into a chunk of at most `body` tokens. The
    whole window when it fits; else first come, first served with every prompt's last token held back, so
    no prompt of the window finishes before the others (a trailing 0: that prompt waits this step)."""
    if sum(r - 1 for r in remaining) <= body:
        return list(remaining)
    sizes = []
    for r in remaining:
        n = min(r - 1, body + 1)  # n - 1 of them in the chunk
        sizes.append(n)
        body -= max(0, n - 1)
    return sizes


def chunk_size_of(body: int, buckets: Sequence[int], dynamic: bool) -> int:
    """The length a chunk of `body` tokens runs at (as the token-count scheduler picks it)."""
    if dynamic:
        return max(CHUNK_ALIGN, round_up(body, CHUNK_ALIGN))
    return min(b for b in buckets if b >= body)


class WaveScheduler(ContinuousScheduler):
    """The continuous scheduler with waves kept whole: only a mixed step's prompt pieces differ."""

    def __init__(self, config: RuntimeConfig) -> None:
        super().__init__(config)
        self.step_budget_ms = config.step_budget_ms
        self.step_cost = StepCost(*config.step_cost_us)

    def _pieces(self, rows: int) -> tuple[PrefillChunk, ...]:
        """The first `pieces` prompts' next tokens within the step's time budget beside `rows` decode rows
        (the whole chunk with none; never past `mixed_budget` beside them), finishing together."""
        tokens = self.chunk_tokens
        if rows:
            tokens = min(self.mixed_budget, self.step_cost.tokens_within(self.step_budget_ms, rows))
        body = chunk_limit(tokens, self.chunk_buckets, self.dynamic_chunks)
        window = self.prefilling[: self.pieces]
        sizes = wave_pieces([r.num_tokens - r.num_computed_tokens for r in window], body)
        pieces = [(req, n) for req, n in zip(window, sizes, strict=True) if n > 0]
        bucket = chunk_size_of(sum(n - 1 for _, n in pieces), self.chunk_buckets, self.dynamic_chunks)
        return tuple(self._chunk(req, n, bucket) for req, n in pieces)
