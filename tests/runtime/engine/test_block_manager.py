"""The paged KV block manager, with no model: golden tables of allocate / append / free, prefix sharing,
eviction order. Block size 4 keeps the tables readable; block 0 is scratch and never handed out."""

import pytest
from spyre_runtime.engine.block_manager import BlockManager


def toks(n, start=0):
    return list(range(start, start + n))


def test_allocate_append_free_table():
    bm = BlockManager(num_blocks=6, enable_prefix_caching=False, block_size=4)
    rows = []
    a = bm.allocate("a", toks(6))  # 2 blocks
    rows.append(("alloc a 6", a.block_table, a.num_cached_tokens, bm.num_free_blocks))
    rows.append(("append a 8", bm.append("a", 8), None, bm.num_free_blocks))  # still 2 blocks
    rows.append(("append a 9", bm.append("a", 9), None, bm.num_free_blocks))  # a third block
    b = bm.allocate("b", toks(5))
    rows.append(("alloc b 5", b.block_table, b.num_cached_tokens, bm.num_free_blocks))
    assert not bm.can_allocate(toks(4)) and not bm.can_append("a", 13)
    bm.free("a")
    rows.append(("free a", None, None, bm.num_free_blocks))
    c = bm.allocate("c", toks(12))
    rows.append(("alloc c 12", c.block_table, c.num_cached_tokens, bm.num_free_blocks))
    assert rows == [
        ("alloc a 6", (1, 2), 0, 3),
        ("append a 8", (1, 2), None, 3),
        ("append a 9", (1, 2, 3), None, 2),
        ("alloc b 5", (4, 5), 0, 0),
        ("free a", None, None, 3),
        ("alloc c 12", (3, 2, 1), 0, 0),  # freed in reverse order, taken oldest-freed first
    ]
    with pytest.raises(MemoryError):
        bm.allocate("d", toks(1))


def test_shared_prefix_reuses_whole_blocks_with_reference_counts():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = bm.allocate("a", toks(10))  # blocks for [0-3] [4-7] [8-9]; the two full ones are shareable
    assert bm.allocate("early", toks(10)).num_cached_tokens == 0  # nothing computed yet: no hit
    bm.free("early")
    bm.commit("a", 10)
    b = bm.allocate("b", [*toks(8), 100, 101, 102])  # same first 8 tokens
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    # a prompt that differs inside the first block shares nothing
    c = bm.allocate("c", [9, *toks(7, 1), 5])
    assert c.num_cached_tokens == 0
    # the last token is always computed: an exact repeat of 8 tokens reuses only the first block
    d = bm.allocate("d", toks(8))
    assert d.num_cached_tokens == 4 and d.block_table[0] == a.block_table[0]


def test_freed_blocks_stay_cached_until_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=5, block_size=4)  # 4 usable blocks
    a = bm.allocate("a", toks(9))  # 3 blocks, 2 hashed
    bm.commit("a", 9)
    bm.free("a")
    assert bm.num_free_blocks == 4
    again = bm.allocate("a2", toks(9))
    assert again.num_cached_tokens == 8 and again.block_table[:2] == a.block_table[:2]
    bm.commit("a2", 9)
    bm.free("a2")
    # new data takes the free blocks in freeing order; taking a hashed block evicts its content
    bm.allocate("x", toks(16, 1000))
    bm.free("x")
    cold = bm.allocate("a3", toks(9))
    assert cold.num_cached_tokens == 0


def test_can_allocate_counts_hits_on_blocks_in_use():
    bm = BlockManager(num_blocks=4, block_size=4)  # 3 usable blocks
    bm.allocate("a", toks(9))  # all 3 blocks, 2 of them shareable
    bm.commit("a", 9)
    assert bm.num_free_blocks == 0
    # a request sharing both full blocks still needs one block for its own tail: none is free
    assert not bm.can_allocate([*toks(8), 7])
    bm.free("a")
    assert bm.can_allocate([*toks(8), 7])
    shared = bm.allocate("b", [*toks(8), 7])
    assert shared.num_cached_tokens == 8
