"""Plain-PyTorch paged attention (CPU path, and the oracle the Triton GPU kernels are tested against).

Cache layout per layer is `[2, kv_heads, num_blocks, block_size, head_dim]` (K then V,
head-major), so gathering whole blocks along dim 2 yields `[2, kv_heads, n*block_size, D]`:
K and V in one op, in 2 KiB chunks rather than per-token rows, already in the layout matmul
wants (no transpose copies, which dominated decode time otherwise).

Decode rows are attended in length buckets: each bucket's blocks are gathered into one padded
`[B, max_blocks * block_size]` batch, and the query heads sharing a KV head are stacked as
extra query rows (`[kv_heads, B, group, D]`), so GQA needs no K/V copies. Matmul + softmax beats SDPA here
for a handful of query rows per sequence. Prefill chunks use SDPA (causal, GQA-aware).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata, DecodeBucket, PrefillSpan


def write_kv_cache(kv_cache, k, v, slot_mapping) -> None:
    write_kv_cache_layers(kv_cache.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), slot_mapping)


def write_kv_cache_layers(kv_data, k, v, slot_mapping) -> None:
    layers, _, kv_heads, _, _, head_dim = kv_data.shape
    flat = kv_data.view(layers, 2, kv_heads, -1, head_dim)
    flat[:, 0].index_copy_(2, slot_mapping, k.transpose(1, 2))
    flat[:, 1].index_copy_(2, slot_mapping, v.transpose(1, 2))


def paged_attention(q, k, v, kv_cache, meta: AttentionMetadata, decode=None) -> torch.Tensor:
    """`decode(q_rows, kv_cache, bucket, scale)` attends decode buckets (default: `_decode`)."""
    decode = decode or _decode
    buckets = meta.decode_buckets
    if len(buckets) == 1 and not meta.prefills and buckets[0].covers(q.shape[0]):
        return decode(q, kv_cache, buckets[0], meta.scale)  # decode-only step: the kernel's output is all of it
    out = torch.empty_like(q)
    for bucket in buckets:
        rows = bucket.row_index()  # a slice (views) when the rows are consecutive
        out[rows] = decode(q[rows], kv_cache, bucket, meta.scale)
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        out[rows] = _prefill(q[rows], k[rows], v[rows], kv_cache, span, meta.scale)
    return out


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, reversed: torch.Tensor | None = None
) -> torch.Tensor:
    """`[2, kv_heads, *block_ids.shape[:-1], block_ids.shape[-1] * block_size, D]` copy of
    K and V in the given blocks, in logical order: blocks flagged in `reversed` (same shape
    as `block_ids`) are flipped within the block after the gather."""
    _, kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    flat = kv_cache.view(2 * kv_heads, num_blocks, block_size * head_dim)
    out = flat.index_select(1, block_ids.reshape(-1))
    if reversed is not None:
        flip = reversed.reshape(-1).nonzero().squeeze(1)
        if flip.numel():
            blocks = out.view(2 * kv_heads, -1, block_size, head_dim)
            blocks[:, flip] = blocks[:, flip].flip(2)
    return out.view(2, kv_heads, *block_ids.shape[:-1], block_ids.shape[-1] * block_size, head_dim)


def _decode(q, kv_cache, bucket: DecodeBucket, scale: float) -> torch.Tensor:
    batch, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[1]
    keys, values = gather_blocks(kv_cache, bucket.block_table, bucket.reversed)  # each [kvh, B, L, D]
    qg = q.view(batch, kv_heads, heads // kv_heads, head_dim).transpose(0, 1)  # [kvh, B, g, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float()  # [kvh, B, g, L]
    scores.mul_(scale).add_(bucket.bias)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).transpose(0, 1).reshape(batch, heads, head_dim)


def _prefill(q, k, v, kv_cache, span: PrefillSpan, scale: float) -> torch.Tensor:
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    if span.block_ids is None:
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        kv_len = span.ctx_len + span.q_len
        kh, vh = gather_blocks(kv_cache, span.block_ids, span.reversed)[:, :, :kv_len].unsqueeze(1)  # [1, kvh, L, D]
        mask = _causal_mask(span.q_len, span.ctx_len, q.device)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _causal_mask(q_len: int, ctx_len: int, device) -> torch.Tensor:
    """Row i (absolute position ctx_len + i) may see keys 0..ctx_len + i."""
    cols = torch.arange(ctx_len + q_len, device=device)
    rows = torch.arange(q_len, device=device).unsqueeze(1) + ctx_len
    return cols.unsqueeze(0) <= rows
