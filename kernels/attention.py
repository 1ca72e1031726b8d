"""Paged attention: the contract between the model runner and the kernels.

The per-step inputs (`AttentionMetadata` and what it holds) are in `kernels/metadata.py`;
this module dispatches each op to the kernel that runs it.

KV cache layout, per layer: one tensor `[2, num_kv_heads, num_blocks, block_size,
head_dim]` (K then V; head-major, so a gather of blocks is directly a per-head matrix). A
token's *slot* is `block_id * block_size + offset`. New tokens are written by slot; reads
go through per-sequence block lists built by the runner from block tables, plus a direction
bit per block (BROS): a *reversed* block holds logical offset o at in-block slot
`block_size - 1 - o` (a BE request filling from the right end). Gathers return keys in
logical order whatever the directions, so the attention math (and its floating-point
summation order) is the same as for forward blocks.
"""

from __future__ import annotations

import torch

from kernels.compiled import decode as _compiled
from kernels.metadata import AttentionMetadata, DecodeBucket, DecodeChunks, PrefillSpan
from kernels.reference import attention as _ref

__all__ = [
    "AttentionMetadata",
    "DecodeBucket",
    "DecodeChunks",
    "PrefillSpan",
    "decode_attention_with_new",
    "paged_attention",
    "write_kv_cache",
    "write_kv_cache_layers",
]


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) at their slots."""
    _ref.write_kv_cache(kv_cache, k, v, slot_mapping)


def write_kv_cache_layers(kv_data: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Every layer at once: kv_data is the whole cache `[layers, 2, kv_heads, blocks, block_size,
    head_dim]`, k and v are `[layers, T, kv_heads, head_dim]` (a compiled decode step's output)."""
    _ref.write_kv_cache_layers(kv_data, k, v, slot_mapping)


def decode_attention_with_new(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    chunks: tuple[torch.Tensor, ...],
    scale: float,
) -> torch.Tensor:
    """Decode attention for tracing inside a compiled layer: one query row per sequence (q
    [S, heads, D]) over its cached context, given as `kernels.compiled.decode.graph_chunks`
    of a bucket whose lengths exclude this step's token, plus that token's own k, v ([S,
    kv_heads, D], not in the cache). Returns [S, heads, D]."""
    return _compiled.decode_with_new_math(q, k, v, kv_cache, *chunks, scale)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cached and new tokens.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] (already written to the cache).
    Returns [T, heads, head_dim]. Heads are grouped as in Hugging Face's `repeat_kv`:
    query head h reads KV head h // (heads // kv_heads).
    """
    if meta.decode_kernel == "fused":
        return _ref.paged_attention(q, k, v, kv_cache, meta, decode=_compiled.decode)
    return _ref.paged_attention(q, k, v, kv_cache, meta)
