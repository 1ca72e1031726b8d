"""eLLM's transient prefix on the Triton kernels: the contract of
`kernels/reference/resident.py` (`attend_transient`).

A partially resident sequence's query rows attend two parts, each one launch for all the
step's `TransientSpan`s, both writing one compact float32 buffer (row i is the i-th query
row of the spans, in span order):

- the rebuilt prefix: this layer's rows `prefix_start ..` of the step's k, v (positions
  `0 .. prefix_len-1`, all before the queries), by the partial-attention kernel
  (`partial.attend_segments`);
- the paged rest: the existing prefill/extend kernel (`extend.py`) reads the cached keys at
  positions `[prefix_len, ctx_len)` through the span's block list (its empty prefix entries
  are never looked at: the read starts at `kv_from = prefix_len`) and the span's own new
  tokens from k, v, causally, and returns its log-sum-exp too (`WITH_LSE`).

The parts are merged exactly (`partial.merge_parts`, the merge the HIDDEN form uses) and the
rows written to `out` in the model's dtype. Decode rows of partially resident sequences take
the extend kernel as one-token spans: no split-K for them yet (a GPU tuning item,
docs/gpu.md). The plan (segment and span tables, output rows) is built on the first layer's
call and reused by every layer (`AttentionMetadata.prepared`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.metadata import PrefillSpan
from kernels.triton.extend import extend
from kernels.triton.partial import Segment, SegmentPlan, attend_segments, fp32_dot_for, merge_parts, segment_plan
from kernels.triton.plan import ExtendPlan, extend_plan
from kernels.triton.tiles import TileConfig, tile_config

if TYPE_CHECKING:
    from kernels.metadata import AttentionMetadata


@dataclass(frozen=True)
class TransientPlan:
    rows: torch.Tensor  # [R] the spans' query rows in the flattened batch, in span order
    prefix: SegmentPlan  # the rebuilt prefixes
    paged: ExtendPlan  # the resident parts, from kv_from = prefix_len


def attend_transient(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    tiles: TileConfig | None = None,
) -> None:
    """Fill every transient span's rows of `out` (in place); `tiles` overrides the device's (tests).
    Host-kept prefixes (`meta.host_prefix`, this layer's) are attended as rows appended after
    the step's own K/V, so the prefix kernel reads one tensor."""
    tiles = tiles or tile_config(kv_cache.device)
    heads, head_dim = q.shape[1], q.shape[2]
    host_row0 = k.shape[0]
    if meta.host_prefix is not None:
        k = torch.cat([k, meta.host_prefix.keys])
        v = torch.cat([v, meta.host_prefix.values])
    plan = _plan(meta, heads // kv_cache.shape[1], tiles, q.device, host_row0)
    rows = plan.rows.shape[0]
    outs = torch.empty(2, rows, heads, head_dim, dtype=torch.float32, device=q.device)
    lses = torch.empty(2, rows, heads, dtype=torch.float32, device=q.device)
    fp32_dot = fp32_dot_for(kv_cache.dtype)
    attend_segments(q, k, v, plan.prefix, meta.scale, outs[0], lses[0], tiles, fp32_dot)
    extend(q, k, v, kv_cache, outs[1], plan.paged, meta.scale, tiles, fp32_dot, lse=lses[1])
    merged, _ = merge_parts(outs, lses)
    out.index_copy_(0, plan.rows, merged.to(out.dtype))


def _plan(
    meta: AttentionMetadata, group: int, tiles: TileConfig, device: torch.device, host_row0: int
) -> TransientPlan:
    key = ("triton-transient", group, tiles)
    plan = meta.prepared.get(key)
    if plan is None:
        segments, spans, kv_from, o_start, rows, row = [], [], [], [], [], 0
        for s in meta.transient:
            prefix_row = s.prefix_start + (host_row0 if s.from_host else 0)
            segments.append(Segment(s.q_start, s.q_len, s.ctx_len, prefix_row, s.prefix_len, 0, row))
            spans.append(PrefillSpan(s.q_start, s.q_len, s.ctx_len, s.block_ids))
            kv_from.append(s.prefix_len)
            o_start.append(row)
            rows.extend(range(s.q_start, s.q_start + s.q_len))
            row += s.q_len
        plan = meta.prepared[key] = TransientPlan(
            rows=torch.tensor(rows, dtype=torch.long).to(device),
            prefix=segment_plan(segments, group, tiles, device),
            paged=extend_plan(spans, group, tiles, device, kv_from=kv_from, o_start=o_start),
        )
    return plan
