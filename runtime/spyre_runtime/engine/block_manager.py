"""Paged KV-cache bookkeeping for continuous batching: which cache blocks each sequence owns. No tensors.

    blocks:  [0: scratch] [1] [2] [3] ... [num_blocks-1]        BLOCK_SIZE token slots each
    a sequence's block table maps its token i to block table[i // BLOCK_SIZE], offset i % BLOCK_SIZE

Prefix caching: a *full* prompt block is named by a hash chained over every token up to its end, so two
prompts that start with the same whole blocks share them (reference counts). A block is published under its
hash only once its KV has been computed (`commit`), so a prefill that is aborted or still running never
hands half-written blocks to another request. A block whose count drops to zero
goes to the back of the free queue but keeps its hash: it can still be hit until it is taken for new data
(least recently freed first), which evicts it. The last prompt token is always computed, so a hit never
covers the whole prompt. Invariant: every block other than scratch is either referenced (ref_count > 0) or in
the free queue, never both.

Sliding window (`window` > 0: every attention layer sees only its last `window` tokens): once a decoding
sequence's next token is past a block's last token by `window` or more, no layer reads that block again;
`free_outside_window` returns it (the table keeps the scratch block in its place, so positions still map).

KV events (`record_events`): publishing a block under its hash records a `BlockStored` (one per commit, for
the consecutive blocks it published), evicting one a `BlockRemoved`; `take_events()` hands them over once per
engine step (engine/kv_events.py sends them in vLLM's format).
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from spyre_contract.architectures import kv_window

from spyre_runtime.engine.kv_events import BlockRemoved, BlockStored, KVCacheEvent, external_block_hash
from spyre_runtime.executor.kv_cache import BLOCK_SIZE, SCRATCH_BLOCK

log = logging.getLogger(__name__)


def window_for(model_dir: Path) -> int:
    """The sliding window the block manager frees blocks by (0: none), from the model's config.json; says at
    start-up what a window does to the KV cache and to prefix caching."""
    try:
        model_config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    window, note = kv_window(model_config)
    if note:
        log.info("%s", note)
    return window


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    content_hash: int | None = None


@dataclass(frozen=True)
class Allocation:
    block_table: tuple[int, ...]
    num_cached_tokens: int  # prompt tokens whose KV is already in the cache (a multiple of the block size)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        block_size: int = BLOCK_SIZE,
        record_events: bool = False,
        window: int = 0,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is scratch)")
        self.block_size = block_size
        self.window = window
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: deque[int] = deque(i for i in range(num_blocks) if i != SCRATCH_BLOCK)
        self.cached: dict[int, int] = {}  # content hash -> block id
        self.tables: dict[str, list[int]] = {}
        self._pending: dict[str, list[int]] = {}  # seq -> hashes of its shareable blocks, by block index
        self._prompts: dict[str, list[int]] = {}  # seq -> its tokens at allocation (when recording events)
        self.events: list[KVCacheEvent] | None = [] if record_events else None

    # ---- queries ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - 1 - len(self.free_queue)

    @property
    def num_pool_blocks(self) -> int:
        """Blocks sequences can hold (all but scratch)."""
        return len(self.blocks) - 1

    def block_table(self, seq_id: str) -> tuple[int, ...]:
        return tuple(self.tables[seq_id])

    def _hashes(self, token_ids: list[int], salt: int = 0) -> list[int]:
        """Chained hashes of the full blocks that may be shared (never the block holding the last token).
        `salt` starts the chain: what the tokens alone do not say (a request's images)."""
        if not self.enable_prefix_caching:
            return []
        shareable = (len(token_ids) - 1) // self.block_size
        hashes, prev = [], salt
        for i in range(shareable):
            prev = hash((prev, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])))
            hashes.append(prev)
        return hashes

    def _hits(self, hashes: list[int]) -> list[int]:
        hits = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, token_ids: list[int], salt: int = 0) -> bool:
        hits = self._hits(self._hashes(token_ids, salt))
        in_use = sum(self.blocks[b].ref_count > 0 for b in hits)
        return blocks_for_size(len(token_ids), self.block_size) - in_use <= self.num_free_blocks

    # ---- changes ---------------------------------------------------------------------------------

    def allocate(self, seq_id: str, token_ids: list[int], salt: int = 0) -> Allocation:
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not self.can_allocate(token_ids, salt):
            raise MemoryError(f"not enough free KV blocks for {len(token_ids)} tokens")
        hashes = self._hashes(token_ids, salt)
        hits = self._hits(hashes)
        table = []
        for block_id in hits:
            self._take(block_id)
            table.append(block_id)
        for _ in range(len(hits), blocks_for_size(len(token_ids), self.block_size)):
            table.append(self._take_free())
        self.tables[seq_id] = table
        self._pending[seq_id] = hashes
        if self.events is not None and hashes:
            self._prompts[seq_id] = list(token_ids[: len(hashes) * self.block_size])
        return Allocation(tuple(table), len(hits) * self.block_size)

    def commit(self, seq_id: str, num_computed_tokens: int) -> None:
        """Publishes the sequence's shareable blocks whose KV is now computed (its first
        `num_computed_tokens` tokens), so later prompts can hit them."""
        hashes, table = self._pending.get(seq_id, []), self.tables[seq_id]
        published = []
        for i in range(min(len(hashes), num_computed_tokens // self.block_size)):
            block = self.blocks[table[i]]
            if block.content_hash is None and hashes[i] not in self.cached:
                block.content_hash = hashes[i]
                self.cached[hashes[i]] = block.block_id
                published.append(i)
        if self.events is not None and published:
            self._record_stored(seq_id, hashes, published)

    def _record_stored(self, seq_id: str, hashes: list[int], published: list[int]) -> None:
        """One BlockStored per run of consecutive block indices published by a commit."""
        runs: list[list[int]] = []
        for i in published:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        tokens = self._prompts[seq_id]
        for run in runs:
            first, end = run[0], run[-1] + 1
            self.events.append(
                BlockStored(
                    block_hashes=tuple(external_block_hash(h) for h in hashes[first:end]),
                    parent_block_hash=external_block_hash(hashes[first - 1]) if first else None,
                    token_ids=tuple(tokens[first * self.block_size : end * self.block_size]),
                    block_size=self.block_size,
                )
            )

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call (none when not recording)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def can_append(self, seq_id: str, num_tokens: int) -> bool:
        """Whether the sequence can grow to `num_tokens` tokens."""
        needed = blocks_for_size(num_tokens, self.block_size) - len(self.tables[seq_id])
        return needed <= self.num_free_blocks

    def append(self, seq_id: str, num_tokens: int) -> tuple[int, ...]:
        """Grows the block table to hold `num_tokens` tokens; returns the table."""
        if not self.can_append(seq_id, num_tokens):
            raise MemoryError(f"not enough free KV blocks to grow {seq_id} to {num_tokens} tokens")
        table = self.tables[seq_id]
        while len(table) < blocks_for_size(num_tokens, self.block_size):
            table.append(self._take_free())
        return tuple(table)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Releases the sequence's blocks beyond those `num_tokens` tokens need (a rejected draft's: never
        hashed, never shared)."""
        table = self.tables[seq_id]
        while len(table) > max(1, blocks_for_size(num_tokens, self.block_size)):
            self._release(table.pop())

    def free(self, seq_id: str) -> None:
        """Releases the sequence's blocks; shared prompt blocks stay cached until evicted."""
        self._pending.pop(seq_id, None)
        self._prompts.pop(seq_id, None)
        for block_id in reversed(self.tables.pop(seq_id)):
            self._release(block_id)

    def free_outside_window(self, seq_id: str, position: int) -> int:
        """With a sliding window: releases the blocks the token at `position` and every later one can no
        longer see (all of a block's slots at or before `position - window`); returns how many."""
        if not self.window:
            return 0
        table = self.tables[seq_id]
        num_freed = 0
        for i in range(max(0, position - self.window + 1) // self.block_size):
            if table[i] != SCRATCH_BLOCK:
                self._release(table[i])
                table[i] = SCRATCH_BLOCK
                num_freed += 1
        return num_freed

    def _release(self, block_id: int) -> None:
        if block_id == SCRATCH_BLOCK:  # a place freed by the window
            return
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue.append(block_id)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_queue.remove(block_id)
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id = self.free_queue.popleft()
        block = self.blocks[block_id]
        if block.content_hash is not None:  # evict its cached content
            if self.cached.get(block.content_hash) == block_id:
                del self.cached[block.content_hash]
                if self.events is not None:
                    self.events.append(BlockRemoved((external_block_hash(block.content_hash),)))
            block.content_hash = None
        block.ref_count = 1
        return block_id


def blocks_for_size(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
