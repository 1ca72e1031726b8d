"""A step's attention metadata in the form the Triton kernels read, built once per step.

`AttentionMetadata` is kernel-neutral (decode buckets with padded block tables and float
masks, prefill spans with Python ints and per-span block lists). The first layer's call
turns it into flat integer tensors on the device (sequence lengths, padded tables, direction
bytes, the prefill kernel's tile list) plus the split-K scratch buffers, and every later layer
reuses them (`AttentionMetadata.prepared`). Nothing here waits on the device: lengths are
counted on the device from the masks, and split counts come from table widths, which the host
knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels.triton.tiles import TileConfig, decode_splits

if TYPE_CHECKING:
    from kernels import AttentionMetadata, DecodeBucket, PrefillSpan

_HOLE = -1  # table padding the kernels must not dereference (see common.paged_offsets)


@dataclass(frozen=True)
class DecodePlan:
    """One decode bucket: `rows` of q/out, each row's context length, table and directions."""

    rows: torch.Tensor  # [B] rows in the flattened batch
    lens: torch.Tensor  # [B] int32 tokens in each context (this step's token included)
    table: torch.Tensor  # [B, W] blocks (the runner's padding is never read: lens bound it)
    reversed: torch.Tensor | None  # [B, W] int8 direction bits; None when all forward
    splits: int  # parts each context is cut into (1: no merge)
    partial_out: torch.Tensor | None  # [B, heads, splits, D] float32 unnormalised split outputs
    partial_max: torch.Tensor | None  # [B, heads, splits] float32 score maxima (base 2)
    partial_sum: torch.Tensor | None  # [B, heads, splits] float32 sums of exponentials


@dataclass(frozen=True)
class ExtendPlan:
    """Every prefill span, and the prefill kernel's programs: one per (span, query tile)."""

    q_start: torch.Tensor  # [P] first row of each span in the flattened batch
    q_len: torch.Tensor  # [P] new tokens
    ctx_len: torch.Tensor  # [P] tokens already in the cache (the prefix)
    kv_from: torch.Tensor  # [P] first key position attended (0; eLLM's paged part: the first resident one)
    o_start: torch.Tensor  # [P] output row of each span's first token (q_start; or a compact buffer's)
    table: torch.Tensor  # [P, W] blocks of each prefix, holes (-1) past it
    reversed: torch.Tensor | None  # [P, W] int8 direction bits; None when all forward
    tile_span: torch.Tensor  # [N] span of each program
    tile_first: torch.Tensor  # [N] its first query token within the span
    tokens_per_tile: int


@dataclass(frozen=True)
class StepPlan:
    decodes: list[DecodePlan]
    extend: ExtendPlan | None


def step_plan(
    meta: AttentionMetadata, heads: int, kv_heads: int, head_dim: int, block_size: int, tiles: TileConfig
) -> StepPlan:
    """The plan of this step for a model of this shape, built on the first call and then reused."""
    key = ("triton", heads, kv_heads, head_dim, block_size, tiles)
    plan = meta.prepared.get(key)
    if plan is None:
        device = meta.slot_mapping.device
        decodes = [_decode_plan(b, heads, kv_heads, head_dim, block_size, tiles) for b in meta.decode_buckets]
        extend = extend_plan(meta.prefills, heads // kv_heads, tiles, device) if meta.prefills else None
        plan = meta.prepared[key] = StepPlan(decodes, extend)
    return plan


def tokens_per_tile(group: int, tiles: TileConfig) -> int:
    """Query tokens per prefill program: its rows are tokens x the `group` heads of one KV head."""
    return max(1, tiles.extend_rows // group)


def _decode_plan(
    bucket: DecodeBucket, heads: int, kv_heads: int, head_dim: int, block_size: int, tiles: TileConfig
) -> DecodePlan:
    seqs, width = bucket.block_table.shape
    lens = (bucket.bias[:, 0] == 0).sum(-1, dtype=torch.int32)  # valid slots are each row's logical prefix
    splits = decode_splits(tiles, seqs, kv_heads, width * block_size)
    partial = (None, None, None)
    if splits > 1:
        device = bucket.block_table.device
        partial = (
            torch.empty(seqs, heads, splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(seqs, heads, splits, dtype=torch.float32, device=device),
            torch.empty(seqs, heads, splits, dtype=torch.float32, device=device),
        )
    return DecodePlan(
        rows=bucket.rows,
        lens=lens,
        table=bucket.block_table,
        reversed=None if bucket.reversed is None else bucket.reversed.view(torch.int8),
        splits=splits,
        partial_out=partial[0],
        partial_max=partial[1],
        partial_sum=partial[2],
    )


def extend_plan(
    spans: list[PrefillSpan],
    group: int,
    tiles: TileConfig,
    device: torch.device,
    kv_from: list[int] | None = None,
    o_start: list[int] | None = None,
) -> ExtendPlan:
    """The prefill kernel's form of `spans`; `kv_from` (default 0) and `o_start` (default each
    span's q_start) serve eLLM's paged part (kernels/triton/resident.py)."""
    per_tile = tokens_per_tile(group, tiles)
    tile_span, tile_first = [], []
    for i, span in enumerate(spans):
        for first in range(0, span.q_len, per_tile):
            tile_span.append(i)
            tile_first.append(first)
    table, reversed_bits = _prefix_tables(spans, device)
    starts = [s.q_start for s in spans]
    ints = torch.tensor(
        [starts, [s.q_len for s in spans], [s.ctx_len for s in spans], kv_from or [0] * len(spans), o_start or starts],
        dtype=torch.int32,
    ).to(device)
    tile_list = torch.tensor([tile_span, tile_first], dtype=torch.int32).to(device)
    return ExtendPlan(*ints, table, reversed_bits, tile_list[0], tile_list[1], per_tile)


def _prefix_tables(spans: list[PrefillSpan], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[P, W] prefix blocks (holes where a span has fewer blocks or no prefix) and direction bytes."""
    width = max((s.block_ids.shape[0] for s in spans if s.block_ids is not None), default=1)
    rows, bits = [], []
    for s in spans:
        if s.block_ids is None:
            rows.append(torch.full((width,), _HOLE, dtype=torch.long, device=device))
            bits.append(torch.zeros(width, dtype=torch.int8, device=device))
            continue
        pad = width - s.block_ids.shape[0]
        rows.append(F.pad(s.block_ids.to(torch.long), (0, pad), value=_HOLE))
        flags = torch.zeros(s.block_ids.shape[0], dtype=torch.int8, device=device)
        if s.reversed is not None:
            flags = s.reversed.view(torch.int8)
        bits.append(F.pad(flags, (0, pad)))
    any_reversed = any(s.reversed is not None for s in spans)
    return torch.stack(rows), (torch.stack(bits) if any_reversed else None)
