"""A wave's prompts start decoding together (SENDNN_INFERENCE_CB_WAVE_START): the continuous scheduler's
start of a prompt's decode. No tensors.

A wave is the prompts that arrive together (a client's fixed concurrency refills its streams at once). When
it takes more than one step to prefill, the token-count scheduler starts each prompt's decode as soon as its
own prefill ends: the wave's first prompts decode while the rest prefill, finish a step or more before them,
their successors arrive apart, and from then on every wave's prefill stalls the other part's decode
(bench/README.md run 20b; run 43: ITL p99 3.98x vLLM's under its client with a wave split in two). Keeping
the wave in one step (waves.py, or a chunk that holds it) keeps it in step, but then every prompt's first
token waits for the whole wave's prefill.

With the setting on, a prompt whose prefill ends sends its first token at once, as before, and then sits out
the decode steps (keeping its blocks and its sequence slot) until the other prompts of its wave are
prefilled: those that arrived before its prefill ended (by their arrival time: the engine adds a request at
the start of a step) and are prefilling, or waiting within the free sequence slots, at the next step. Later
arrivals and a longer queue are the next wave's. So the wave decodes from one step on and its streams stay
in step, no first token waits for the rest of the wave, and no stream's second token comes later than if the
wave had been prefilled in one step (but for the extra steps' fixed cost). A held request never waits on
what cannot start: when no prompt is prefilling and none can be admitted (sequence slots, blocks, the
volumetric limit), every held request starts. A request that its first token finished, or a stream resumed
after a preemption, is never held. On by default (bench/README.md runs 44 and 45, with steps of up to 4
prompts, the runtime's default); off (0), a prompt decodes from the step after its prefill.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spyre_runtime.request import Request


class WaveStart:
    """The continuous scheduler's start of a prefilled prompt's decode (its attributes: `wave_start`, `held`,
    `admitted`, `waiting`, `prefilling`, `running`, `max_num_seqs`, `num_running`, `_admissible`)."""

    def _hold_for_wave(self, prefilled: list[Request]) -> None:
        """The prompts this step prefilled start decoding, or, with `wave_start`, those that got their first
        token are held, stamped with the time their prefill ended (their wave is taken at the next step)."""
        now = time.monotonic()
        for req in prefilled:
            if self.wave_start and req.num_output_tokens == 1 and not req.is_finished:
                self.held[req] = now
            else:  # finished, or resumed after a preemption (its stream already runs): no wave to wait for
                self.running.append(req)

    def _start_waves(self) -> None:
        """Held requests whose wave is prefilled start decoding. A request's wave is taken at the first step
        after its prefill: the prompts prefilling then, and those waiting that the free sequence slots hold,
        that arrived before its prefill ended (later ones are the next wave). All held requests start when
        no prompt is prefilling and none can be admitted. The running list stays in admission order."""
        if not self.held:
            return
        undecided = [req for req, wave in self.held.items() if isinstance(wave, float)]  # prefill end times
        if undecided:
            free = max(0, self.max_num_seqs - self.num_running)
            pending = [*self.prefilling, *itertools.islice(self.waiting, free)]
            for req in undecided:
                ended = self.held[req]
                self.held[req] = frozenset(r.request_id for r in pending if r.arrival_time <= ended)
        stuck = not self.prefilling and not (self.waiting and self._admissible(self.waiting[0]))
        pending_ids = {r.request_id for r in [*self.waiting, *self.prefilling]}
        start = [r for r, wave in self.held.items() if stuck or not wave & pending_ids]
        for req in start:
            del self.held[req]
        if start:
            self.running = sorted([*self.running, *start], key=self._admission_order().__getitem__)

    def _admission_order(self) -> dict[Request, int]:
        return {r: i for i, r in enumerate(self.admitted)}

    def _newest_started(self) -> Request:
        """The preemption victim among the requests past their prefill (decoding or held): the newest."""
        order = self._admission_order()
        return max([*self.running, *self.held], key=order.__getitem__)
