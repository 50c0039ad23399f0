"""A preallocated, paged KV cache of fixed shape, plugged into FMS through its attention-op registry.

FMS's default cache grows with torch.cat, so a compiled forward would recompile at every decode step. Here
every layer owns two fixed tensors `[num_blocks, BLOCK_SIZE, kv_heads, head_dim]` written in place, and the
attention kwargs are fixed-shape tensors:

    slot_mapping [B, L]   flat slot (block * BLOCK_SIZE + offset) where each input token's K/V is stored
    mask         [B, L, K] bool: which of the K keys each query sees
    block_table  [B, nb]  blocks of each row; K = nb * BLOCK_SIZE keys are gathered from the cache
    slab_start   int      instead of a block table: row r owns blocks slab_start + r*nb ... (static
                          batching), so the context is a view of the cache and nothing is gathered
    seq_lens     [B]      with `block_table` [B, nb] and no mask (continuous-batching decode, one token per
                          row): paged attention over each row's own first seq_lens[r] slots, in an op that is
                          opaque to the compiler (`paged_decode`), so the keys read follow the rows' real
                          lengths, not a bucket: one graph per batch bucket, and a step reads only live KV
    mixed        True     a mixed step (continuous batching, vLLM's chunked prefill): one row of T + B
                          tokens, a chunk region of T tokens holding pieces of up to P prompts, then B decode
                          tokens, through every linear layer once. Token t of the region belongs to piece
                          `token_piece[t]` (-1: padding) at position `token_pos[t]`; piece p attends to the
                          first `piece_lens[p]` slots of its request's blocks `piece_tables[p]` (earlier
                          chunks, prefix-cache hits and its own tokens, causally) in `paged_prefill`, an op
                          opaque to the compiler; the decode tokens as `seq_lens` above
    (none of them: a prefill with no earlier context attends to the fresh keys)

    static_decode True    with `seq_lens`: the same attention in plain static-shape tensor ops
                          (`static_paged_decode`, `static_paged_prefill`), for sendnn, which cannot call the
                          opaque ops

Block 0 is scratch: dummy rows and padding tokens write there, and only they read it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from spyre_runtime.executor.attention import attend, window_mask
from spyre_runtime.executor.kernels import paged_attention
from spyre_runtime.executor.linear import live_decode_row_count
from spyre_runtime.executor.ops import opaque_op

# no "paged" nor "sdpa" in it: FMS's granite_swa blocks swap such names for their own sink ops
ATTN_NAME = "spyre_serve_kv"
BLOCK_SIZE = 64
SCRATCH_BLOCK = 0

_layouts: dict | None = None  # within `step_layouts`: what the step's first layer worked out, for the others


@contextlib.contextmanager
def step_layouts() -> Iterator[None]:
    """Within: one forward pass. Every layer's paged op reads the same blocks of the same rows (only the
    cache tensors differ), so the first layer works the layout out and the others reuse it."""
    global _layouts
    before, _layouts = _layouts, {}
    try:
        yield
    finally:
        _layouts = before


def _store(keys, values, key_cache, value_cache, **attn_kwargs):
    # keys/values: [B, L, kvh, hd]; caches: [num_blocks, BLOCK_SIZE, kvh, hd], in the model's dtype or a
    # narrower one (--kv-cache-dtype): what is read back from them is widened to the model's again
    slots, cached = attn_kwargs["slot_mapping"].reshape(-1), key_cache.dtype
    for new, cache in ((keys, key_cache), (values, value_cache)):
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, new.reshape(-1, *new.shape[2:]).to(cached))
    if attn_kwargs.get("seq_lens") is not None:  # paged decode (or mixed): the op reads the cache itself
        return key_cache, value_cache, key_cache, value_cache
    slab_start = attn_kwargs.get("slab_start")
    if slab_start is not None:
        # rows own consecutive blocks: the context is a view of the cache, nothing is gathered
        rows, num_keys = attn_kwargs["mask"].shape[0], attn_kwargs["mask"].shape[-1]
        end = slab_start + rows * (num_keys // BLOCK_SIZE)
        keys_ctx = key_cache[slab_start:end].view(rows, num_keys, *key_cache.shape[2:]).to(keys.dtype)
        values_ctx = value_cache[slab_start:end].view(rows, num_keys, *value_cache.shape[2:]).to(keys.dtype)
        return keys_ctx, values_ctx, key_cache, value_cache
    block_table = attn_kwargs.get("block_table")
    if block_table is None:
        return keys, values, key_cache, value_cache
    keys_ctx = key_cache[block_table].flatten(1, 2).to(keys.dtype)  # [B, nb * BLOCK_SIZE, kvh, hd]
    values_ctx = value_cache[block_table].flatten(1, 2).to(keys.dtype)
    return keys_ctx, values_ctx, key_cache, value_cache


def _decode(query, keys, values, scale, sinks, window, attn_kwargs):
    """One token per row (query [B, h, hd]) against its row's cached slots: the paged decode op, or its
    static twin for device compilers."""
    op = _decode_op(attn_kwargs)
    return op(query, keys, values, attn_kwargs["block_table"], attn_kwargs["seq_lens"], scale, sinks, window)


def _compute(query, keys, values, nheads, kvheads, p_dropout, scale_factor, **attn_kwargs):
    # query: [B, L, h, hd]; keys/values: [B, K, kvh, hd] (or the caches, see _store) -> [B, L, h, hd]
    scale = query.shape[-1] ** -0.5 if scale_factor is None else scale_factor
    # a sliding-window layer sees its last `window` tokens (0: all); a layer with attention sinks
    # (granite_swa) adds one learned logit per head to each softmax's denominator
    window, sinks = int(attn_kwargs.get("sliding_window") or 0), attn_kwargs.get("sinks")
    if attn_kwargs.get("mixed"):
        region = attn_kwargs["token_piece"].shape[0]  # symbolic with dynamic chunks
        static = attn_kwargs.get("static_decode")
        prefill = (static_paged_prefill if static else paged_prefill)(
            query[0, :region],
            keys,
            values,
            attn_kwargs["piece_tables"],
            attn_kwargs["piece_lens"],
            attn_kwargs["token_piece"],
            attn_kwargs["token_pos"],
            scale,
            sinks,
            window,
        )
        decode = _decode(query[0, region:], keys, values, scale, sinks, window, attn_kwargs)
        return torch.cat([prefill, decode])[None]
    if attn_kwargs.get("seq_lens") is not None:
        return _decode(query[:, 0], keys, values, scale, sinks, window, attn_kwargs)[:, None]
    mask = attn_kwargs["mask"]
    if window:
        mask = window_mask(mask, window)
    return _sdpa(query, keys, values, mask, nheads, kvheads, scale, sinks)


def _sdpa(query, keys, values, mask, nheads, kvheads, scale, sinks=None):
    # query: [B, L, h, hd]; keys/values: [B, K, kvh, hd]; mask: [B, L, K] -> [B, L, h, hd]
    out = attend(
        query.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        mask.unsqueeze(1),
        scale,
        None if sinks is None else sinks.view(1, -1, 1, 1),
        enable_gqa=nheads != kvheads,
    )
    return out.transpose(1, 2).contiguous()


def _fake_attention(query, *_):
    return torch.empty_like(query)


@opaque_op(
    "paged_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor seq_lens, "
    "float scale, Tensor? sinks=None, int window=0) -> Tensor",
    _fake_attention,
)
def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """One token per row against the row's own first seq_lens[r] cached tokens (with `window`, its last
    `window` of them: the blocks before every row's window are not read).
    query: [B, h, hd]; caches: [num_blocks, BLOCK_SIZE, kvh, hd]; block_table: [B, nb]; seq_lens: [B] ->
    [B, h, hd]. Opaque to the compiler: the keys gathered follow this step's longest row (a Python int here),
    so the compiled graph keeps one static shape while a step reads only live blocks; in a step whose first
    n rows only are live (linear.live_rows), the other rows read nothing and come out zero. The query heads
    that share a KV head are that head's queries (FMS's and torch's GQA order: head i uses KV head i //
    group). In a mixed step the hint is the live decode rows of its decode part (linear.live_rows).
    Runs the C++ kernel that reads the blocks in place (kernels/paged_attention.py) where it is built, else
    the ATen ops below (its fallback and oracle)."""
    live = live_decode_row_count()
    kernel = paged_attention.kernel()
    if kernel is not None and paged_attention.takes(query, key_cache):
        rows = -1 if live is None else live
        return kernel(query, key_cache, value_cache, block_table, seq_lens, scale, sinks, window, rows)
    if live is None or live >= query.shape[0]:
        layout = _decode_layout(block_table, seq_lens, window=window)
        return _attend_live_blocks(query, key_cache, value_cache, layout, scale, sinks)
    out = torch.zeros_like(query)  # dummy rows (linear.live_rows): zeros, nothing read
    if live:
        layout = _decode_layout(block_table, seq_lens, live, window)
        out[:live] = _attend_live_blocks(query[:live], key_cache, value_cache, layout, scale, sinks)
    return out


def _decode_layout(block_table, seq_lens, live=None, window=0):
    """What every layer of a decode step reads the same way: the blocks (flat) of the live rows up to the
    longest one's length, that length, and the mask past each row's length. Computed by the step's first
    layer (see `step_layouts`)."""
    cached = _layouts.get(("decode", live, window)) if _layouts is not None else None
    if cached is not None:
        return cached
    if live is not None:
        block_table, seq_lens = block_table[:live], seq_lens[:live]
    length = int(seq_lens.max())
    # with a window: from the first block any row's window reaches (earlier ones may be freed: scratch)
    first = max(0, int(seq_lens.min()) - window) // BLOCK_SIZE if window else 0
    blocks = block_table[:, first : -(-length // BLOCK_SIZE)].flatten()
    slots = torch.arange(first * BLOCK_SIZE, length)
    mask = slots < seq_lens[:, None]
    if window:
        mask &= slots >= seq_lens[:, None] - window
    layout = (blocks, length - first * BLOCK_SIZE, mask[:, None, None])  # mask: [B, 1, 1, L]
    if _layouts is not None:
        _layouts[("decode", live, window)] = layout
    return layout


def _attend_live_blocks(query, key_cache, value_cache, layout, scale, sinks=None):
    """Row r's query heads against its first seq_lens[r] slots (`layout`: see _decode_layout). The query
    heads that share a KV head are that head's query length (no GQA expansion)."""
    blocks, length, mask = layout
    rows, nheads, head_dim = query.shape
    kvheads = key_cache.shape[2]
    # index_select: about 2x faster than key_cache[table]
    keys = key_cache.index_select(0, blocks).view(rows, -1, kvheads, head_dim)[:, :length].transpose(1, 2)
    values = value_cache.index_select(0, blocks).view(rows, -1, kvheads, head_dim)[:, :length].transpose(1, 2)
    keys, values = keys.to(query.dtype), values.to(query.dtype)  # a narrower cache (--kv-cache-dtype)
    grouped = query.view(rows, kvheads, nheads // kvheads, head_dim)
    sinks = None if sinks is None else sinks.view(1, kvheads, -1, 1)
    out = attend(grouped, keys, values, mask, scale, sinks)  # the group's heads as its query length
    return out.reshape(rows, nheads, head_dim)


def static_paged_decode(query, key_cache, value_cache, block_table, seq_lens, scale, sinks=None, window=0):
    """What `paged_decode` computes, in plain tensor ops of static shape (every row gathers the whole width
    of its block table, masked past its length): for device compilers (sendnn) that lower the graph
    themselves and cannot call back into Python."""
    length = block_table.shape[1] * BLOCK_SIZE
    slots = torch.arange(length)
    mask = (slots < seq_lens[:, None]) & (slots >= seq_lens[:, None] - window if window else True)
    layout = (block_table.flatten(), length, mask[:, None, None])
    return _attend_live_blocks(query, key_cache, value_cache, layout, scale, sinks)


@opaque_op(
    "paged_prefill(Tensor query, Tensor key_cache, Tensor value_cache, Tensor piece_tables, "
    "Tensor piece_lens, Tensor token_piece, Tensor token_pos, float scale, Tensor? sinks=None, int window=0) "
    "-> Tensor",
    _fake_attention,
)
def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    piece_tables: torch.Tensor,
    piece_lens: torch.Tensor,
    token_piece: torch.Tensor,
    token_pos: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """The chunk region of a mixed step: pieces of several prompts, each token against its own request's
    cached tokens up to its position (their K/V, this step's included, are already in the cache).
    query: [T, h, hd]; piece_tables: [P, nb]; piece_lens: [P] (0: no such piece); token_piece, token_pos:
    [T] -> [T, h, hd], zeros for padding tokens. Opaque to the compiler: each piece reads only the blocks it
    uses, and the pieces' lengths and layout change from step to step under one graph. A piece of consecutive
    positions runs the C++ kernel that reads its blocks in place (kernels/paged_prefill.cpp) where the
    extension is built, else the ATen ops below (its fallback and oracle)."""
    query = query.contiguous()
    out = torch.zeros_like(query)
    layout = _prefill_layout(piece_tables, piece_lens, token_piece, token_pos, window)
    kernel = paged_attention.prefill_kernel() if paged_attention.takes(query, key_cache) else None
    for rows, first, blocks, visible, start in layout:
        if kernel is not None and start is not None and query.shape[-1] % 16 == 0:  # the C++ kernel, in place
            kernel(query, rows, out, key_cache, value_cache, blocks, start, scale, sinks, window)
            continue
        if first is not None:  # the piece's blocks are consecutive: a view of the cache, nothing gathered
            keys, values = key_cache[first : first + len(blocks)], value_cache[first : first + len(blocks)]
        else:
            keys, values = key_cache.index_select(0, blocks), value_cache.index_select(0, blocks)
        length = visible.shape[1] if visible is not None else rows.shape[0]
        piece = _attend_piece(query.index_select(0, rows), keys, values, length, visible, scale, sinks)
        out.index_copy_(0, rows, piece)
    return out


def _prefill_layout(piece_tables, piece_lens, token_piece, token_pos, window=0):
    """Per piece, what every layer of a mixed step reads the same way: its tokens in the region (in
    position order), its first block when its blocks are consecutive (else None), its block table, what
    each token sees (`visible` is None when the piece is its prompt's start: causal from slot 0, attention
    skips the masked half instead of reading a mask), and its first position when its positions are
    consecutive (the C++ kernel's case, kernels/paged_prefill.cpp; else None). Computed by the
    step's first layer (`step_layouts`)."""
    cached = _layouts.get(("prefill", window)) if _layouts is not None else None
    if cached is not None:
        return cached
    layout = []
    for p, length in enumerate(piece_lens.tolist()):
        if length == 0:
            continue
        rows = (token_piece == p).nonzero().squeeze(1)
        positions = token_pos.index_select(0, rows)
        order = positions.argsort()
        rows, positions = rows[order], positions[order]
        nb = -(-length // BLOCK_SIZE)
        blocks = piece_tables[p, :nb]
        first = int(blocks[0])
        consecutive = bool((blocks == torch.arange(first, first + nb)).all())
        slots = torch.arange(length)
        if rows.shape[0] == length and bool((positions == slots).all()) and not 0 < window < length:
            visible = None
        else:
            visible = slots <= positions[:, None]  # causal, [n, length]
            if window:
                visible &= slots > positions[:, None] - window
        start = int(positions[0]) if bool((positions == positions[0] + slots[: len(rows)]).all()) else None
        layout.append((rows, first if consecutive else None, blocks, visible, start))
    if _layouts is not None:
        _layouts[("prefill", window)] = layout
    return layout


def static_paged_prefill(
    query,
    key_cache,
    value_cache,
    piece_tables,
    piece_lens,
    token_piece,
    token_pos,
    scale,
    sinks=None,
    window=0,
):
    """What `paged_prefill` computes, in plain tensor ops of static shape: every token against every piece's
    whole block table, the piece's own result kept (device compilers, see `static_paged_decode`)."""
    length = piece_tables.shape[1] * BLOCK_SIZE
    keys = torch.arange(length)
    causal = keys <= token_pos[:, None]  # [T, length]
    if window:
        causal &= keys > token_pos[:, None] - window
    first = keys == 0  # every other token sees one key: a finite row, discarded
    out = torch.zeros_like(query)
    for p in range(piece_tables.shape[0]):
        mine = token_piece == p
        visible = (causal & mine[:, None]) | (first & ~mine[:, None])
        table = piece_tables[p]
        o = _attend_piece(query, key_cache[table], value_cache[table], length, visible, scale, sinks)
        out = torch.where(mine[:, None, None], o, out)
    return out


def _attend_piece(query, keys, values, length, visible, scale, sinks=None):
    """Query tokens [n, h, hd] against the first `length` slots of the piece's blocks `keys`, `values`
    [nb, BLOCK_SIZE, kvh, hd] under `visible` [n, length], or causally from slot 0 when it is None (token i
    sees slots 0..i; n == length). GQA: query head i uses KV head i // group. -> [n, h, hd]."""
    _, nheads, head_dim = query.shape
    kvheads = keys.shape[2]
    keys = keys.reshape(-1, kvheads, head_dim)[:length].transpose(0, 1).to(query.dtype)
    values = values.reshape(-1, kvheads, head_dim)[:length].transpose(0, 1).to(query.dtype)
    out = attend(
        query.transpose(0, 1)[None],
        keys[None],
        values[None],
        None if visible is None else visible[None, None],
        scale,
        None if sinks is None else sinks.view(1, -1, 1, 1),
        is_causal=visible is None,
        enable_gqa=nheads != kvheads,
    )
    return out[0].transpose(0, 1)


def _decode_op(attn_kwargs):
    return static_paged_decode if attn_kwargs.get("static_decode") else paged_decode


def register() -> None:
    """Registers the op with FMS once per process (FMS refuses a second registration of a name)."""
    from fms.modules import attention

    with contextlib.suppress(KeyError):
        attention.register_attention_op(ATTN_NAME, _store, _compute)


class KVCachePool:
    """The per-layer cache tensors; handed to the model as `past_key_value_states`."""

    def __init__(self, num_layers: int, num_blocks: int, kv_heads: int, head_dim: int, dtype=torch.float32):
        shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.layers = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)
