"""Beam search as HF transformers runs it (GenerationMixin._beam_search, 5.x), as a pure state machine:
`advance` takes each running beam's most likely next tokens and their logprobs and decides; whoever drives
it runs the model. The engine runs each step's beams as ordinary requests of one token on the
continuous-batching scheduler, so beams share their prompt's KV blocks through the prefix cache.

Per step, with w = width and K = max(2, 1 + number of EOS ids) * w:
    candidates   the K best (beam score + token logprob) over all running beams (so each beam's own top K
                 suffice); the first step has one beam (HF starts the others at -1e9)
    hits         a candidate that is an EOS id, or the max_tokens-th token
    running      the w best candidates that are not hits (hits only when too few are not)
    finished     hits among the first w candidates join the finished hypotheses, scored
                 sum(logprobs) / generated_length ** length_penalty (EOS counted); the best w are kept
    stop         early_stopping True: w finished; False: w finished and the best running beam, scored at
                 its current length, cannot beat the worst of them; "never": the same, at max_tokens when
                 length_penalty > 0; always: every candidate is a hit (max_tokens)
"""

from __future__ import annotations

from dataclasses import dataclass

FILTERED = -1.0e9  # HF's score for what may not be chosen


@dataclass(frozen=True)
class Beam:
    tokens: tuple[int, ...]  # generated so far
    logprob: float  # their summed logprobs (-1e9 added when it is a hit kept only to fill the beams)


@dataclass(frozen=True)
class Hypothesis:
    tokens: tuple[int, ...]  # generated, the EOS id included when it ended there
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(tokens) ** length_penalty
    is_eos: bool


class BeamSearch:
    def __init__(
        self,
        width: int,
        max_tokens: int,
        eos_ids: frozenset[int] | set[int],
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
    ) -> None:
        self.width = width
        self.max_tokens = max_tokens
        self.eos_ids = frozenset(eos_ids)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_candidates = max(2, 1 + len(self.eos_ids)) * width
        self.running: list[Beam] = [Beam((), 0.0)]
        self.finished: list[Hypothesis] = []
        self.num_generated = 0
        self.can_improve = True
        self.done = False

    def advance(self, tops: list[list[tuple[int, float]]]) -> None:
        """tops[b]: running beam b's next tokens with their logprobs, at least `num_candidates` of them
        (or the whole vocabulary), best first."""
        if len(tops) != len(self.running):
            raise ValueError(f"expected the next tokens of {len(self.running)} beams, got {len(tops)}")
        scored = [
            (beam.logprob + logprob, b, rank, token)
            for b, (beam, top) in enumerate(zip(self.running, tops, strict=True))
            for rank, (token, logprob) in enumerate(top[: self.num_candidates])
        ]
        scored.sort(key=lambda c: (-c[0], c[1], c[2]))  # HF's topk over beam-major indices
        candidates = scored[: self.num_candidates]
        length = self.num_generated + 1
        hits = [token in self.eos_ids or length >= self.max_tokens for _, _, _, token in candidates]
        grown = [
            Beam((*self.running[b].tokens, token), logprob + (FILTERED if hit else 0.0))
            for (logprob, b, _, token), hit in zip(candidates, hits, strict=True)
        ]
        order = sorted(range(len(grown)), key=lambda i: -grown[i].logprob)  # stable: ties keep their order
        new = [
            Hypothesis(grown[i].tokens, logprob, logprob / length**self.length_penalty, token in self.eos_ids)
            for i, ((logprob, _, _, token), hit) in enumerate(
                zip(candidates[: self.width], hits, strict=False)
            )
            if hit
        ]
        self.finished = sorted(self.finished + new, key=lambda h: -h.score)[: self.width]
        self.running = [grown[i] for i in order[: self.width]]
        self.num_generated = length
        self._check_stop(all(hits))

    def _check_stop(self, all_hits: bool) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = self.num_generated
        best_possible = self.running[0].logprob / best_length**self.length_penalty
        full = len(self.finished) == self.width
        worst = self.finished[-1].score if full else FILTERED
        self.can_improve = self.can_improve and (best_possible > worst or not full)
        closed = full and self.early_stopping is True
        self.done = not self.can_improve or closed or all_hits

    def results(self) -> list[Hypothesis]:
        """The finished hypotheses, best first (`width` of them once done)."""
        return list(self.finished)
