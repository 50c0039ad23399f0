"""What the executor runs: the schedulers' plain step descriptions (no tensors).

A scheduler returns one of these from `schedule()`; the executor computes it; the engine appends the sampled
tokens to `step.requests` in row order.
"""

from __future__ import annotations

from dataclasses import dataclass

from spyre_runtime.config import Shape
from spyre_runtime.request import Request


@dataclass(frozen=True)
class StaticStep:
    """A plain description of one step. `requests` fill the first rows of the shape; the executor pads
    the remaining `shape.batch_size - len(requests)` rows with dummies. `decode_index` is t for the
    t-th decode step after the prefill (0 for the first decode, ignored for a prefill)."""

    is_prefill: bool
    shape: Shape
    requests: tuple[Request, ...]
    decode_index: int = 0

    @property
    def scheduled(self) -> tuple[Request, ...]:
        return self.requests if self.is_prefill else ()

    @property
    def occupancy(self) -> float:
        return len(self.requests) / self.shape.batch_size


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
    draft: bool = False  # an n-gram draft after its request's row (engine/sched/speculation.py)


@dataclass(frozen=True)
class ContinuousStep:
    chunks: tuple[PrefillChunk, ...] = ()  # prefill pieces, one per prompt (one alone unless mixed)
    decode: tuple[DecodeRow, ...] = ()
    batch_size: int = 1  # decode bucket
    kv_len: int = 0  # decode bucket

    mixed: bool = False  # the chunk and the decode rows run as one forward
    pieces: int = 0  # mixed: places for the pieces' last tokens beside the chunk bucket

    @property
    def is_prefill(self) -> bool:
        return bool(self.chunks)

    @property
    def chunk_size(self) -> int:
        """The chunk bucket the step runs at (0: no chunk)."""
        return self.chunks[0].chunk_size if self.chunks else 0

    @property
    def requests(self) -> tuple[Request, ...]:
        """The requests that receive a sampled token from this step, in row order: the decode rows, then
        the prefilled requests whose chunk ends their prompt, in chunk order."""
        done = tuple(chunk.request for chunk in self.chunks if chunk.is_last)
        return tuple(row.request for row in self.decode) + done

    @property
    def scheduled(self) -> tuple[Request, ...]:
        """Requests whose prompt this step computes (their scheduled time is the first such step)."""
        return tuple(chunk.request for chunk in self.chunks)

    @property
    def occupancy(self) -> float:
        """Live tokens / tokens the step's graph computes."""
        live = sum(len(chunk.token_ids) for chunk in self.chunks) + len(self.decode)
        computed = self.chunk_size + self.pieces
        if self.decode or self.mixed or not self.chunks:
            computed += self.batch_size
        return live / max(1, computed)

    @property
    def num_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks) + len(self.decode)
