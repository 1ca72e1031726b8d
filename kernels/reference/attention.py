"""Plain-PyTorch paged attention (CPU path, and the reference for GPU kernels).

Cache layout per layer is head-major: `[kv_heads, num_blocks, block_size, head_dim]`, so
gathering a batch of slots along dim 1 yields `[kv_heads, n, head_dim]`, already in the
layout matmul wants (no transpose copies, which dominated decode time otherwise).

Decode rows are attended in length buckets: each bucket's slots are gathered into one padded
`[B, max_len]` batch, and the query heads sharing a KV head are stacked as extra query rows
(`[kv_heads, B, group, D]`), so GQA needs no K/V copies. Matmul + softmax beats SDPA here
for a handful of query rows per sequence. Prefill chunks use SDPA (causal, GQA-aware).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kernels.attention import AttentionMetadata, DecodeBucket, PrefillSpan


def write_kv_cache(k_cache, v_cache, k, v, slot_mapping) -> None:
    kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def paged_attention(q, k, v, k_cache, v_cache, meta: "AttentionMetadata") -> torch.Tensor:
    out = torch.empty_like(q)
    for bucket in meta.decode_buckets:
        out[bucket.rows] = _decode(q[bucket.rows], k_cache, v_cache, bucket, meta.scale)
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, span, meta.scale)
    return out


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`[kv_heads, *slots.shape, head_dim]` copy of the cached vectors at `slots`."""
    kv_heads, head_dim = cache.shape[0], cache.shape[-1]
    flat = cache.view(kv_heads, -1, head_dim)
    return flat.index_select(1, slots.reshape(-1)).view(kv_heads, *slots.shape, head_dim)


def _decode(q, k_cache, v_cache, bucket: "DecodeBucket", scale: float) -> torch.Tensor:
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    keys = gather_slots(k_cache, bucket.slots)  # [kvh, B, L, D]
    values = gather_slots(v_cache, bucket.slots)
    qg = q.view(batch, kv_heads, heads // kv_heads, head_dim).transpose(0, 1)  # [kvh, B, g, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float()  # [kvh, B, g, L]
    scores.mul_(scale).add_(bucket.bias)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).transpose(0, 1).reshape(batch, heads, head_dim)


def _prefill(q, k, v, k_cache, v_cache, span: "PrefillSpan", scale: float) -> torch.Tensor:
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    if span.kv_slots is None:
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        kh = gather_slots(k_cache, span.kv_slots).unsqueeze(0)  # [1, kvh, L, D]
        vh = gather_slots(v_cache, span.kv_slots).unsqueeze(0)
        mask = _causal_mask(span.q_len, span.ctx_len, q.device)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _causal_mask(q_len: int, ctx_len: int, device) -> torch.Tensor:
    """Row i (absolute position ctx_len + i) may see keys 0..ctx_len + i."""
    cols = torch.arange(ctx_len + q_len, device=device)
    rows = torch.arange(q_len, device=device).unsqueeze(1) + ctx_len
    return cols.unsqueeze(0) <= rows
