"""The batched sampler: one call per engine step samples every row at once. Each processor is a tensor op
over the rows that asked for it; no per-row loop touches the vocabulary (a seeded row draws its one uniform
from its own generator, as vLLM keeps a generator per seeded request), and no full-vocabulary sort
runs at all.

    logits [B, V] raw ─► logprobs (of the raw logits: vLLM's default "raw_logprobs")  rows that ask
                      ─► logit_bias, min_tokens (EOS/stop ids banned), grammar mask, penalties
                      ─► greedy rows: argmax
                      ─► other rows: / temperature ─► top_k ─► softmax ─► top_p, min_p ─► inverse CDF draw

The draw takes one uniform per row (an inverse CDF in two levels: blocks' masses, then one block's cumulative
sums), not one random number per vocabulary entry. The float32 logits the sampler works on (and their
softmax, made in place) live in memory kept from one step to the next (`_scratch_copy`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spyre_runtime.sampling.params import (
    TOP_P_CANDIDATES,
    SamplingParams,
    TokenLogprob,
)


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # one per row; None where the request did not ask

    def __len__(self) -> int:
        return len(self.token_ids)


def sample(logits: torch.Tensor, rows: Sequence, drafts: Sequence[int | None] = ()) -> SamplerOutput:
    """logits: [B, V] raw, one row per request in `rows` (objects with `sampling`, `generator`,
    `prompt_token_ids`, `output_token_ids`, `guide`). Returns one token per row. `drafts[i]`: the n-gram
    draft the next row checks (engine/sched/speculation.py), which a sampled row i draws as speculative
    sampling does for a certain draft: the draft with its probability, else a token of the others."""
    num_rows = len(rows)
    if num_rows == 0:
        return SamplerOutput([], [])
    logits = logits[:num_rows]
    params = [r.sampling for r in rows]
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw_logprobs = torch.log_softmax(logits[lp_rows].float(), dim=-1) if lp_rows else None
    if all(p.is_greedy for p in params) and not _needs_processing(rows, params):
        # in float32: ATen's argmax over 16-bit floats took 5x the time of the conversion and the argmax
        tokens = torch.argmax(logits if logits.dtype == torch.float32 else _scratch_copy(logits), dim=-1)
    else:
        logits = _scratch_copy(logits)  # the sampler's own float32 copy, made once
        apply_logit_processors(logits, rows, params)
        tokens = _draw(logits, rows, params, drafts)
    token_list = tokens.tolist()
    logprobs: list[TokenLogprob | None] = [None] * num_rows
    if lp_rows:
        chosen = tokens[lp_rows]
        for j, lp in enumerate(token_logprobs(raw_logprobs, chosen, [params[i].logprobs for i in lp_rows])):
            logprobs[lp_rows[j]] = lp
    return SamplerOutput(token_list, logprobs)


_SCRATCH = threading.local()  # per thread (the engine's): the float32 rows of the last steps


def _scratch_copy(logits: torch.Tensor) -> torch.Tensor:
    """A float32 copy of logits [R, V], written into memory this thread keeps between steps (grown to the
    most rows seen). A fresh copy each step (6.3 MB at 32 rows of a 49,152-token vocabulary, and as much again
    for the softmax) had glibc hand the heap's top back to the kernel after the step and fault it in again on
    the next: up to 4.8 million minor faults in one 32-stream phase (bench/README.md, run 47). Valid until
    this thread's next call."""
    rows, vocab = logits.shape
    kept = getattr(_SCRATCH, "rows", None)
    if kept is None or kept.shape[1] != vocab or kept.shape[0] < rows:
        kept = _SCRATCH.rows = torch.empty(rows, vocab)
    return kept[:rows].copy_(logits)


def _needs_processing(rows: Sequence, params: list[SamplingParams]) -> bool:
    return any(
        p.logit_bias
        or p.has_penalties
        or getattr(r, "guide", None) is not None
        or (p.min_tokens and len(r.output_token_ids) < p.min_tokens)
        for r, p in zip(rows, params, strict=True)
    )


def apply_logit_processors(logits: torch.Tensor, rows: Sequence, params: list[SamplingParams]) -> None:
    """In place on logits [B, V]: logit_bias, min_tokens bans, grammar masks, penalties."""
    vocab = logits.shape[1]
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if t < vocab]
    if bias:
        r, t, b = zip(*bias, strict=True)
        logits.index_put_((torch.tensor(r), torch.tensor(t)), torch.tensor(b), accumulate=True)
    banned = [
        (i, t)
        for i, (row, p) in enumerate(zip(rows, params, strict=True))
        if p.min_tokens and len(row.output_token_ids) < p.min_tokens
        for t in {*p.eos_token_ids, *p.stop_token_ids}
        if t < vocab
    ]
    if banned:
        r, t = zip(*banned, strict=True)
        logits[torch.tensor(r), torch.tensor(t)] = float("-inf")
    guided = [i for i, row in enumerate(rows) if getattr(row, "guide", None) is not None]
    if guided:
        from spyre_runtime.sampling.guided import apply_guides

        apply_guides(logits, guided, [rows[i].guide for i in guided])
    penalized = [i for i, p in enumerate(params) if p.has_penalties]
    if penalized:
        _apply_penalties(logits, penalized, [rows[i] for i in penalized])


def _padded(seqs: list[list[int]], pad: int) -> torch.Tensor:
    width = max(1, max(len(s) for s in seqs))
    out = torch.full((len(seqs), width), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def _apply_penalties(logits: torch.Tensor, idx: list[int], rows: Sequence) -> None:
    """vLLM's rules: presence and frequency penalties count output tokens; the repetition penalty divides
    positive (multiplies negative) logits of every token seen in the prompt or the output."""
    vocab = logits.shape[1]
    sub = logits[idx]
    out_ids = _padded([[t for t in r.output_token_ids if t < vocab] for r in rows], vocab)
    counts = torch.zeros(len(rows), vocab + 1).scatter_add_(1, out_ids, torch.ones(out_ids.shape))[:, :vocab]
    params = [r.sampling for r in rows]
    rep = torch.tensor([p.repetition_penalty for p in params])[:, None]
    if (rep != 1).any():
        prompt_ids = _padded([[t for t in r.prompt_token_ids if t < vocab] for r in rows], vocab)
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool).scatter_(1, prompt_ids, True)[:, :vocab]
        seen |= counts > 0
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([p.frequency_penalty for p in params])[:, None]
    presence = torch.tensor([p.presence_penalty for p in params])[:, None]
    sub = sub - freq * counts - presence * (counts > 0)
    logits[idx] = sub


def _draw(
    logits: torch.Tensor, rows: Sequence, params: list[SamplingParams], drafts: Sequence[int | None] = ()
) -> torch.Tensor:
    """logits [B, V] after the processors -> [B] token ids."""
    random = [i for i, p in enumerate(params) if not p.is_greedy]
    if len(random) < len(params):
        tokens = torch.argmax(logits, dim=-1)
        if not random:
            return tokens
    else:
        tokens = torch.empty(len(params), dtype=torch.long)
    sub = logits if len(random) == len(params) else logits[random]  # `logits` is the sampler's own copy
    sub.div_(torch.tensor([params[i].temperature for i in random])[:, None])
    _top_k(sub, torch.tensor([params[i].top_k for i in random]))
    probs = torch.softmax(sub, dim=-1, out=sub)  # in place: `sub` is the sampler's own
    top_p = torch.tensor([params[i].top_p for i in random])
    if (top_p < 1).any():
        _top_p(probs, top_p)
    min_p = torch.tensor([params[i].min_p for i in random])
    if (min_p > 0).any():
        probs.masked_fill_(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    # inverse CDF: one uniform per row (a seeded row draws it from its own generator)
    uniform = torch.rand(len(random), dtype=torch.float64)
    for j, i in enumerate(random):
        generator = getattr(rows[i], "generator", None)
        if generator is not None:
            uniform[j] = torch.rand(1, generator=generator, dtype=torch.float64)[0]
    checked = [(j, drafts[i]) for j, i in enumerate(random) if i < len(drafts) and drafts[i] is not None]
    kept = _keep_drafts(probs, uniform, checked) if checked else {}
    picked = inverse_cdf(probs, uniform)
    for j, draft in kept.items():
        picked[j] = draft
    tokens[random] = picked
    return tokens


CDF_BLOCK = 256  # tokens a block of the two-level inverse CDF


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (unnormalised, >= 0, some mass in every row), uniform [R] float64 in [0, 1) -> [R] the
    first token whose cumulative mass exceeds u × the row's mass. In two levels, so no float64 copy of the
    rows is made: each block of CDF_BLOCK tokens' mass (summed in float64), the block the target falls in,
    then that block's own cumulative sums. Rounding never picks a token without mass: the block and the
    token are capped at the last ones with mass. A row of NaN (every token masked) gets the last token."""
    rows, vocab = probs.shape
    nblocks = -(-vocab // CDF_BLOCK)
    if nblocks * CDF_BLOCK != vocab:
        probs = torch.nn.functional.pad(probs, (0, nblocks * CDF_BLOCK - vocab))
    blocks = probs.view(rows, nblocks, CDF_BLOCK)
    ends = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [R, nblocks]
    total = ends[:, -1:].contiguous()
    target = uniform[:, None] * total
    block = torch.minimum(torch.searchsorted(ends, target, right=True), torch.searchsorted(ends, total))
    block = block.clamp(max=nblocks - 1)  # a row without mass (NaN: every token masked) sorts past the end
    before = torch.where(block > 0, ends.gather(1, (block - 1).clamp(min=0)), 0.0)
    index = block[:, :, None].expand(rows, 1, CDF_BLOCK)
    within = blocks.gather(1, index)[:, 0].double().cumsum(dim=-1)  # [R, CDF_BLOCK]
    last = torch.searchsorted(within, within[:, -1:].contiguous())
    offset = torch.minimum(torch.searchsorted(within, target - before, right=True), last)
    return (block * CDF_BLOCK + offset).clamp(max=vocab - 1)[:, 0]  # such a row: the last token, as before


def _keep_drafts(probs: torch.Tensor, uniform: torch.Tensor, checked: list[tuple[int, int]]) -> dict:
    """Speculative sampling with a certain draft d (an n-gram's): row j keeps d when its uniform u < p(d);
    otherwise it draws from p without d, with (u - p(d)) / (1 - p(d)), uniform again. So every row draws
    from p exactly. In place: each checked row's d is zeroed and its uniform rescaled; -> {row: d kept}."""
    kept = {}
    for j, draft in checked:
        mass = float(probs[j].sum())
        p = float(probs[j, draft]) / mass if mass > 0 else 0.0
        u = float(uniform[j])
        if u < p:
            kept[j] = draft
        elif p < 1:
            uniform[j] = (u - p) / (1 - p)
            probs[j, draft] = 0.0
    return kept


def _top_k(logits: torch.Tensor, top_k: torch.Tensor) -> None:
    """In place: keeps the k largest logits of rows with k > 0 (ties at the k-th value kept)."""
    vocab = logits.shape[1]
    active = (top_k > 0) & (top_k < vocab)
    if not active.any():
        return
    rows = active.nonzero().flatten()
    k = top_k[rows]
    values = torch.topk(logits[rows], int(k.max()), dim=-1).values  # sorted, [R, kmax]
    kth = values.gather(1, (k - 1)[:, None])
    logits[rows] = logits[rows].masked_fill(logits[rows] < kth, float("-inf"))


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place: keeps the smallest set of most likely tokens whose mass reaches top_p (at least one).
    Looks at the top TOP_P_CANDIDATES of each row; when they hold too little mass, finds the cut by
    bisection over the whole row (still no sort)."""
    rows = (top_p < 1).nonzero().flatten()
    sub, p = probs[rows], top_p[rows][:, None]
    k = min(TOP_P_CANDIDATES, sub.shape[1])
    values = torch.topk(sub, k, dim=-1).values
    cumulative = values.cumsum(dim=-1)
    short = cumulative[:, -1] < p[:, 0]
    threshold = values.gather(1, torch.searchsorted(cumulative, p).clamp(max=k - 1))
    if short.any():
        threshold[short] = _mass_threshold(sub[short], p[short], values[short, -1:])
    probs[rows] = sub.masked_fill(sub < threshold, 0.0)


def _mass_threshold(probs: torch.Tensor, p: torch.Tensor, hi: torch.Tensor, steps: int = 24) -> torch.Tensor:
    """[R, V], [R, 1], [R, 1] -> [R, 1]: the largest t <= hi with sum(probs[probs >= t]) >= p, by bisection
    to hi / 2**steps (no sort: each step is one masked sum over the rows)."""
    lo = torch.zeros_like(p)
    for _ in range(steps):
        mid = (lo + hi) / 2
        enough = (probs * (probs >= mid)).sum(dim=-1, keepdim=True) >= p
        lo = torch.where(enough, mid, lo)
        hi = torch.where(enough, hi, mid)
    return lo


def token_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, nums: list[int]) -> list[TokenLogprob]:
    """logprobs [R, V], chosen [R] -> the chosen token's logprob and rank, and the top nums[r] tokens."""
    picked = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs > picked).sum(dim=-1) + 1
    k = max(nums)
    top_vals, top_ids = torch.topk(logprobs, k, dim=-1) if k else (None, None)
    out = []
    picked_l, ranks_l, chosen_l = picked[:, 0].tolist(), ranks.tolist(), chosen.tolist()
    top_v = top_vals.tolist() if k else None
    top_i = top_ids.tolist() if k else None
    for r, n in enumerate(nums):
        top = tuple(zip(top_i[r][:n], top_v[r][:n], strict=True)) if n else ()
        out.append(TokenLogprob(chosen_l[r], picked_l[r], ranks_l[r], top))
    return out
