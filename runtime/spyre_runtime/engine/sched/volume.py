"""Spyre's volumetric limit, as sendnn-inference 2.x's scheduler applies it. No tensors.

A Spyre card runs a decode step over a rectangular KV: every row is left-padded with dummy blocks to the
widest row's block count, so the step's context (tkv) is the largest padded length, and the card refuses a
step whose rows x tkv pass `VLLM_DT_MAX_BATCH_TKV_LIMIT` (131072 in the 4-card configurations). Two ways to
keep under it (`SENDNN_INFERENCE_PAUSING_ENABLED`):

- pausing (the default): requests are admitted while slots and blocks allow; before each decode step the
  decoding and paused requests are taken in order (the longest paused first; among equals the shortest
  output so far, or the longest with `SENDNN_INFERENCE_LONG_OUT_PRIO=1`) while the step stays under the
  limit; the rest wait this step (paused), keeping their blocks. No new request starts while one is paused.
- no pausing: a request is admitted only if, at every future step, the batch it joins stays under the limit
  at its worst (every row running to its max_tokens): `admits`.

A request that could not run even alone (prompt + max_tokens rounded up to a block past the limit) is
refused before scheduling: `fits_alone`. `Volumetric` applies both in the continuous scheduler.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spyre_contract.environment import TKV_LIMIT_VAR
from spyre_contract.registry import Verdict

from spyre_runtime.config import RuntimeConfig

if TYPE_CHECKING:
    from spyre_runtime.request import Request

log = logging.getLogger(__name__)

BLOCK = 64


def blocks_of(tokens: int, block: int = BLOCK) -> int:
    return -(-tokens // block)


def next_decode_tkv(contexts: Sequence[int], block: int = BLOCK) -> int:
    """The step's tkv when rows holding `contexts` tokens of KV each decode one more token: every row is
    left-padded to the widest row's block count (after its new token); the largest padded length wins."""
    if not contexts:
        return 0
    widest = max(blocks_of(c + 1, block) for c in contexts)
    return max((widest - blocks_of(c + 1, block)) * block + c + 1 for c in contexts)


def step_fits(contexts: Sequence[int], limit: int, block: int = BLOCK) -> bool:
    return not limit or len(contexts) * next_decode_tkv(contexts, block) <= limit


def fits_alone(num_prompt_tokens: int, max_tokens: int, limit: int, block: int = BLOCK) -> bool:
    return not limit or blocks_of(num_prompt_tokens + max_tokens, block) * block <= limit


@dataclass(frozen=True)
class Row:
    """A sequence as the forward check sees it: its context now and the tokens it may still generate."""

    context: int
    remaining: int

    def max_tkv(self, batch_tkv: int, block: int = BLOCK) -> int:
        # its context at its last token, counted from the batch's padded length, plus one block of slack
        # for the re-alignment when the batch changes
        return blocks_of(max(batch_tkv, self.context) + self.remaining - 1, block) * block + block


def admits(new: Row, running: Sequence[Row], limit: int, block: int = BLOCK) -> bool:
    """Whether `new` may join `running` with no future step past `limit`, every row running to its end.
    Rows finish in the order of their largest tkv; the batch shrinks as they do. Rows already running were
    checked when they joined, so only the steps `new` lives through are checked (by induction)."""
    if not limit:
        return True
    batch_tkv = max((r.context for r in running), default=0)
    new_max = blocks_of(max(batch_tkv, new.context) + new.remaining - 1, block) * block + block
    size, worst = len(running) + 1, 0
    for tkv in sorted(r.max_tkv(max(batch_tkv, new.context), block) for r in running):
        if new_max <= tkv:
            return max(worst, size * new_max) <= limit
        worst = max(worst, size * tkv)
        size -= 1
    return max(worst, size * new_max) <= limit


def decode_order(candidates: Sequence[tuple[str, int, int]], long_output_first: bool) -> list[str]:
    """Request ids in the order a paused-aware decode step takes them. `candidates`: (id, steps paused,
    output tokens so far). The longest paused first; among equals the shortest output first (or the
    longest with `long_output_first`); then arrival order."""
    sign = -1 if long_output_first else 1
    ranked = sorted(enumerate(candidates), key=lambda x: (-x[1][1], sign * x[1][2], x[0]))
    return [c[0] for _, c in ranked]


def with_known_tkv_limit(config: RuntimeConfig, verdict: Verdict) -> RuntimeConfig:
    """The known configuration's VLLM_DT_MAX_BATCH_TKV_LIMIT, when the pod's environment does not set one:
    the scheduler and the memory plan enforce it, not only the pod's environment."""
    value = verdict.env.get(TKV_LIMIT_VAR, "")
    if config.max_batch_tkv_limit or not value.strip().isdigit():
        return config
    log.info("%s=%s from the known configuration (%s)", TKV_LIMIT_VAR, value, verdict.message)
    return dataclasses.replace(config, max_batch_tkv_limit=int(value))


class Volumetric:
    """The continuous scheduler's admission and pausing under the limit (its attributes: `tkv_limit`,
    `pausing`, `long_output_first`, `running`, `prefilling`, `held`, `paused`, `steps_paused`, and the
    pause and resume counters)."""

    def _volume_admits(self, req: Request) -> bool:
        """Spyre's volumetric limit at admission: nothing starts while a request is paused; without
        pausing, the forward check of every step the request would live through."""
        if not self.tkv_limit:
            return True
        if self.paused:
            return False
        if self.pausing:
            return True

        def row(r: Request) -> Row:
            return Row(r.num_tokens, r.sampling.max_tokens - r.num_output_tokens)

        rows = [row(r) for r in [*self.running, *self.prefilling, *self.held]]
        return admits(row(req), rows, self.tkv_limit)

    def _pause_over_the_limit(self) -> None:
        """With pausing, the rows of the next decode step: the decoding and paused requests in
        `decode_order` while rows x context stay under the limit; the others sit this step out."""
        if not (self.tkv_limit and self.pausing) or not (self.running or self.paused):
            return
        by_id = {r.request_id: r for r in self.running + self.paused}
        was_paused = {r.request_id for r in self.paused}
        order = decode_order(
            [(rid, self.steps_paused.get(rid, 0), r.num_output_tokens) for rid, r in by_id.items()],
            self.long_output_first,
        )
        decoding: list[Request] = []
        paused: list[Request] = []
        for rid in order:
            req = by_id[rid]
            if step_fits([r.num_tokens - 1 for r in (*decoding, req)], self.tkv_limit):
                decoding.append(req)
                self.steps_paused.pop(rid, None)
            else:
                paused.append(req)
                self.steps_paused[rid] = self.steps_paused.get(rid, 0) + 1
        now_paused = {r.request_id for r in paused}
        self.num_pause_events += len(now_paused - was_paused)
        self.num_resume_events += len(was_paused - now_paused)
        self.running = [r for r in self.running if r.request_id not in now_paused]
        self.running += [r for r in decoding if r.request_id in was_paused]
        self.paused = paused
