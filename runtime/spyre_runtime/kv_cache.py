"""A preallocated, paged KV cache of fixed shape, plugged into FMS through its attention-op registry.

FMS's default cache grows with torch.cat, so a compiled forward would recompile at every decode step. Here
every layer owns two fixed tensors `[num_blocks, BLOCK_SIZE, kv_heads, head_dim]` written in place, and the
attention kwargs are fixed-shape tensors:

    slot_mapping [B, L]   flat slot (block * BLOCK_SIZE + offset) where each input token's K/V is stored
    mask         [B, L, K] bool: which of the K keys each query sees
    block_table  [B, nb]  blocks of each row; K = nb * BLOCK_SIZE keys are gathered from the cache
    slab_start   int      instead of a block table: row r owns blocks slab_start + r*nb ... (static
                          batching), so the context is a view of the cache and nothing is gathered
    whole_cache  True     instead of a block table (continuous-batching decode): every row reads the whole
                          cache in place, K = num_blocks * BLOCK_SIZE, and `mask` [B, 1, K] marks the
                          flat slots of the row's own tokens. Nothing is gathered or copied: a decode step
                          reads the cache once, whatever the rows' lengths and blocks
    mixed        int C    a mixed step (continuous batching, vLLM's chunked prefill): one row of C + B
                          tokens, a prefill chunk of C tokens then B decode tokens, through every linear
                          layer once. The chunk attends to `ctx_slots` [K] (its request's flat slots, gathered
                          from the cache) under `mask` [1, C, K]; the decode tokens read the whole cache
                          under `decode_mask` [B, 1, S] as `whole_cache` does
    (none of them: a prefill with no earlier context attends to the fresh keys)

Block 0 is scratch: dummy rows write there and nobody reads it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

ATTN_NAME = "spyre_serve_paged"
BLOCK_SIZE = 64
SCRATCH_BLOCK = 0


def _store(keys, values, key_cache, value_cache, **attn_kwargs):
    # keys/values: [B, L, kvh, hd]; caches: [num_blocks, BLOCK_SIZE, kvh, hd]
    slots = attn_kwargs["slot_mapping"].reshape(-1)
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, keys.reshape(-1, *keys.shape[2:]))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, values.reshape(-1, *values.shape[2:]))
    if attn_kwargs.get("whole_cache") or attn_kwargs.get("mixed"):
        return key_cache.flatten(0, 1)[None], value_cache.flatten(0, 1)[None], key_cache, value_cache
    slab_start = attn_kwargs.get("slab_start")
    if slab_start is not None:
        # rows own consecutive blocks: the context is a view of the cache, nothing is gathered
        rows, num_keys = attn_kwargs["mask"].shape[0], attn_kwargs["mask"].shape[-1]
        end = slab_start + rows * (num_keys // BLOCK_SIZE)
        keys_ctx = key_cache[slab_start:end].view(rows, num_keys, *key_cache.shape[2:])
        values_ctx = value_cache[slab_start:end].view(rows, num_keys, *value_cache.shape[2:])
        return keys_ctx, values_ctx, key_cache, value_cache
    block_table = attn_kwargs.get("block_table")
    if block_table is None:
        return keys, values, key_cache, value_cache
    keys_ctx = key_cache[block_table].flatten(1, 2)  # [B, nb * BLOCK_SIZE, kvh, hd]
    values_ctx = value_cache[block_table].flatten(1, 2)
    return keys_ctx, values_ctx, key_cache, value_cache


def _compute(query, keys, values, nheads, kvheads, p_dropout, scale_factor, **attn_kwargs):
    # query: [B, L, h, hd]; keys/values: [B, K, kvh, hd]; mask: [B, L, K] -> [B, L, h, hd]
    if attn_kwargs.get("whole_cache"):
        return _whole_cache_decode(query, keys[0], values[0], kvheads, scale_factor, attn_kwargs["mask"])
    chunk = attn_kwargs.get("mixed")
    if chunk:
        # keys/values: the whole cache [1, S, kvh, hd], this step's tokens already stored
        ctx = attn_kwargs["ctx_slots"]
        prefill = _sdpa(
            query[:, :chunk],
            keys[0].index_select(0, ctx)[None],
            values[0].index_select(0, ctx)[None],
            attn_kwargs["mask"],
            nheads,
            kvheads,
            scale_factor,
        )
        rows = query.shape[1] - chunk
        decode = _whole_cache_decode(
            query[0, chunk:].unsqueeze(1),
            keys[0],
            values[0],
            kvheads,
            scale_factor,
            attn_kwargs["decode_mask"],
        )
        return torch.cat([prefill, decode.view(1, rows, nheads, -1)], dim=1)
    return _sdpa(query, keys, values, attn_kwargs["mask"], nheads, kvheads, scale_factor)


def _sdpa(query, keys, values, mask, nheads, kvheads, scale_factor):
    # query: [B, L, h, hd]; keys/values: [B, K, kvh, hd]; mask: [B, L, K] -> [B, L, h, hd]
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask.unsqueeze(1),
        scale=scale_factor,
        enable_gqa=nheads != kvheads,
    )
    return out.transpose(1, 2).contiguous()


def _whole_cache_decode(query, keys, values, kvheads, scale_factor, mask):
    """One token per row against the whole cache, as two batched GEMMs per KV head.
    query: [B, 1, h, hd]; keys/values: [S, kvh, hd] (the cache, flat); mask: [B, 1, S] -> [B, 1, h, hd]"""
    rows, _, nheads, head_dim = query.shape
    group = nheads // kvheads
    scale = head_dim**-0.5 if scale_factor is None else scale_factor
    # [kvh, B * group, hd]: the query heads that share a KV head become rows of one GEMM
    q = (
        query.reshape(rows, kvheads, group, head_dim)
        .permute(1, 0, 2, 3)
        .reshape(kvheads, rows * group, head_dim)
    )
    scores = torch.bmm(q, keys.permute(1, 2, 0)).float() * scale  # [kvh, B * group, S]
    scores = scores.view(kvheads, rows, group, -1).masked_fill(~mask.view(1, rows, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(kvheads, rows * group, -1)
    out = torch.bmm(probs, values.transpose(0, 1))  # [kvh, B * group, hd]
    return out.view(kvheads, rows, group, head_dim).permute(1, 0, 2, 3).reshape(rows, 1, nheads, head_dim)


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
