"""Attention math the paged KV cache's paths share (kv_cache.py): scaled dot-product attention with the
attention sinks of granite_swa (and gpt-oss), and a sliding window laid over a mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(query, keys, values, mask, scale, sinks=None, is_causal=False, enable_gqa=False):
    """Scaled dot-product attention; with `sinks` (broadcastable to [..., h, L, 1], one logit per query
    head) as gpt-oss and granite_swa compute it: the sink joins each softmax, then is dropped.
    query [..., h, L, hd]; keys/values [..., kvh, K, hd]; mask bool, broadcastable to [..., h, L, K]."""
    if sinks is None:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    group = query.shape[-3] // keys.shape[-3]
    if group > 1:
        keys, values = keys.repeat_interleave(group, -3), values.repeat_interleave(group, -3)
    scores = (query @ keys.transpose(-1, -2)) * scale
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return weights.to(values.dtype) @ values


def window_mask(mask, window):
    """mask [B, L, K] (each query's visible keys: slots in position order ending at its own slot, as every
    masked path lays them out) narrowed to the last `window` of them."""
    keys = torch.arange(mask.shape[-1])
    last = mask.shape[-1] - 1 - mask.flip(-1).int().argmax(-1, keepdim=True)  # [B, L, 1]
    return mask & (keys > last - window)
