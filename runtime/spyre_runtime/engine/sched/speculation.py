"""N-gram speculation (SENDNN_INFERENCE_CB_NGRAM_SPEC_TOKENS=k, 0: off, the default): a decoding request
whose last tokens occurred earlier in its prompt or output proposes the (up to) k tokens that followed
them there (prompt lookup, vLLM's `ngram` method), and the step checks them all at once.

The drafts ride as extra decode rows of the request, right after its own row: draft j at position p + j, with
the request's block table, so it attends to the keys up to its own (the step stores every row's K/V before
any row attends). A decode step is bound by reading the weights at a few rows, so rows that would otherwise
be dummies cost little; the drafts only fill the rows the largest decode bucket leaves free, a request's
drafts need blocks that are free now (a draft never preempts), and a step of a full batch carries none.

The engine keeps each draft row's sampled token while every draft before it equalled the token sampled one
row earlier (`accepted`): the request gains 1 to k + 1 tokens a step. A greedy request gets the same tokens as
without speculation, up to the float rounding of GEMMs run at another row count; a sampled one draws each row
with the draft the next row checks (sampling/sampler.py, speculative sampling), so its distribution is the
same. A rejected draft's KV slots are written again by later tokens, its extra blocks go back after the step.
Requests with logprobs, penalties, logit bias, a grammar, a seed or a pending min_tokens do not speculate
(each needs the tokens before a row to be final, or its own draws); static batching, a model with Mamba layers
(its state cannot step back) and Spyre's volumetric limit (rows x context) turn it off.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

from spyre_runtime.request import Request
from spyre_runtime.steps import DecodeRow

NGRAM_MAX = 4  # the longest suffix looked up
NGRAM_MIN = 2  # the shortest


def propose(tokens: Sequence[int], k: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of `tokens`' last n tokens, the longest n first,
    for each n the latest occurrence that k tokens follow (else the one the most tokens follow)."""
    if k <= 0:
        return []
    data = array("i", tokens).tobytes()  # 4 bytes a token: an occurrence is a match at a multiple of 4
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        tail = data[4 * (size - n) :]
        best: list[int] = []
        end = 4 * (size - 1)  # an occurrence ends before the last token, so a token follows it
        while True:
            at = data.rfind(tail, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                start = at // 4 + n
                follow = list(tokens[start : start + k])
                if len(follow) == k:
                    return follow
                if len(follow) > len(best):
                    best = follow
            end = at + 4 * n - 1
        if best:
            return best
    return []


def speculable(req: Request) -> bool:
    """A request whose next token depends on nothing but the logits: greedy, or sampled from torch's
    generator (a seeded request keeps its own sequence of draws, the same with speculation or without)."""
    p = req.sampling
    return (
        (p.is_greedy or req.generator is None)
        and p.logprobs is None
        and not p.logit_bias
        and not p.has_penalties
        and req.guide is None
        and req.num_output_tokens >= p.min_tokens
    )


class Speculation:
    """The continuous scheduler's drafts (its attributes: `spec_tokens`, `tkv_limit`, `batch_buckets`,
    `max_model_len`, `blocks`; its counter `num_draft_tokens`; the engine counts the kept ones)."""

    def _speculate(self, rows: tuple[DecodeRow, ...]) -> tuple[DecodeRow, ...]:
        """`rows` (one per running request) with each speculable request's drafts after its row, within the
        rows the largest decode bucket leaves free."""
        free = max(self.batch_buckets) - len(rows)
        if not self.spec_tokens or self.tkv_limit or free <= 0:
            return rows
        out: list[DecodeRow] = []
        for row in rows:
            req = row.request
            left = min(
                self.spec_tokens,
                free,
                req.sampling.max_tokens - req.num_output_tokens - 1,  # the step's own token is one
                self.max_model_len - req.num_tokens,
            )
            drafts = propose(req.all_token_ids(), left) if left > 0 and speculable(req) else []
            if drafts and self.blocks.can_append(req.request_id, req.num_tokens + len(drafts)):
                table = self.blocks.append(req.request_id, req.num_tokens + len(drafts))
                out.append(DecodeRow(req, row.token_id, row.position, table))
                p = row.position
                out += [DecodeRow(req, d, p + j, table, draft=True) for j, d in enumerate(drafts, 1)]
                free -= len(drafts)
                self.num_draft_tokens += len(drafts)
            else:
                out.append(row)
        return tuple(out)


def accepted(requests: Sequence[Request], rows: Sequence[DecodeRow], tokens: Sequence[int]) -> Iterator[int]:
    """The indices of a step's sampled tokens the requests keep: all but the draft rows' whose draft, or a
    draft before it, differs from the token sampled one row earlier (`requests` in row order, the first
    `len(rows)` of them the decode rows')."""
    rejected = None
    for i in range(len(requests)):
        draft = i < len(rows) and rows[i].draft
        if draft and (requests[i] is rejected or rows[i].token_id != tokens[i - 1]):
            rejected = requests[i]
            continue
        yield i
