"""The menu of compiled shapes continuous batching runs at: every decode step at a (batch size, KV length)
bucket and every prefill chunk at a chunk-size bucket, all of them compiled at warm-up (the Gaudi backend's
bucketing, for static-shape backends). Token counts come in blocks of 64 (PROMPT_LEN_MULTIPLE)."""

from __future__ import annotations

PROMPT_LEN_MULTIPLE = 64


def round_up(n: int, multiple: int = PROMPT_LEN_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def doubling(start: int, top: int) -> tuple[int, ...]:
    """start, 2*start, 4*start, ... below top, then top itself."""
    values, v = [], start
    while v < top:
        values.append(v)
        v *= 2
    return (*values, top)


def chunk_buckets(chunk: int, explicit: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Every multiple of 64 up to 256 (short prompts pad little), then doubling up to the chunk size."""
    if explicit:
        return explicit
    fine = range(PROMPT_LEN_MULTIPLE, min(256, chunk) + 1, PROMPT_LEN_MULTIPLE)
    return tuple(sorted(set(fine) | set(doubling(256, chunk))))


def expand_range(bmin: int, step: int, bmax: int) -> tuple[int, ...]:
    """A bucket range as Gaudi's documentation spells it: powers of two from `bmin` while below `step` (the
    ramp-up), then every multiple of `step` up to `bmax`."""
    ramp, v = [], bmin
    while v < step and v <= bmax:
        ramp.append(v)
        v *= 2
    stable = range(step, bmax + 1, step)
    return tuple(sorted({b for b in (*ramp, *stable) if b >= bmin}))


def batch_buckets(explicit: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    return explicit or doubling(1, max_num_seqs)


def kv_buckets(explicit: tuple[int, ...], max_model_len: int) -> tuple[int, ...]:
    return explicit or doubling(PROMPT_LEN_MULTIPLE, round_up(max_model_len))
