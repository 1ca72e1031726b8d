"""Paged attention: the contract between the model runner and the kernels.

The runner flattens a step's tokens into one batch ordered *decodes first, then prefill
chunks*. Everything that depends only on the batch (slot indices, masks) is built once per
step in `AttentionMetadata` and reused by every layer, so per-layer work is only the math.

KV cache layout, per layer: `k_cache`, `v_cache` of shape `[num_kv_heads, num_blocks,
block_size, head_dim]` (head-major: a gather of slots is directly a per-head matrix). A
token's *slot* is `block_id * block_size + offset`. Slots are
computed by the KV layer from block tables (which may later hold reversed blocks or
non-resident ranges), so kernels only ever see slot indices: logical order in, physical
slots out.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.reference import attention as _ref


@dataclass
class PrefillSpan:
    """One sequence with more than one new token in this step."""

    q_start: int  # first row of this sequence in the flattened batch
    q_len: int  # new tokens in this step
    ctx_len: int  # tokens already in the cache before this step
    kv_slots: torch.Tensor | None  # slots of all ctx_len + q_len tokens; None when ctx_len == 0


@dataclass
class DecodeBucket:
    """Single-token sequences of similar context length, attended as one padded batch."""

    rows: torch.Tensor  # [B] rows of these sequences in the flattened batch
    slots: torch.Tensor  # [B, max_len] slots of each sequence's whole context (padded)
    bias: torch.Tensor  # [B, 1, max_len] float32 additive mask: 0 valid, -inf padding


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by all layers."""

    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    decode_buckets: list[DecodeBucket]
    prefills: list[PrefillSpan]
    scale: float


def write_kv_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) at their slots."""
    _ref.write_kv_cache(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cached and new tokens.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] (already written to the cache).
    Returns [T, heads, head_dim]. Heads are grouped as in Hugging Face's `repeat_kv`:
    query head h reads KV head h // (heads // kv_heads).
    """
    return _ref.paged_attention(q, k, v, k_cache, v_cache, meta)
