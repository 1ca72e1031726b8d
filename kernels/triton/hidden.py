"""HIDDEN rows (the hybrid cache) on the Triton kernels: the contract of `kernels/hidden.py`.

Storing the new tokens' layer inputs, gathering the context's and rebuilding its K/V stay
PyTorch (index copies and the model's own projection, `rebuild`: nothing model-specific
belongs in a kernel). The attention is two parts per sequence, each one launch for the
whole step (`partial.attend_segments`):

- the rebuilt context (rows `ctx_start ..` of the rebuilt K/V, positions `0 .. ctx_len-1`),
  which every new token sees whole;
- the sequence's own new tokens (rows `q_start ..` of this step's k, v, positions
  `ctx_len ..`), causal;

merged exactly by log-sum-exp (`partial.merge_parts`) and written to the sequences' rows of
`out` in the model's dtype. Both parts write one compact float32 buffer (row i is the i-th
HIDDEN row of the step, the order of `HiddenBatch.rows`), so the merge reads it in place.
A sequence without context has an empty first part (lse -inf), which weighs nothing.

Why two parts and a merge rather than one pass over a concatenation: the rebuilt context and
the new tokens live in different tensors, and the reference concatenates them per sequence;
the merge is the same one eLLM's rebuilt prefix uses, so both forms share one tested piece.
The segment tables are built once per step (`HiddenBatch.scratch`) and reused by every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kernels.reference.hidden import gather_hidden, store_hidden
from kernels.triton.partial import Segment, SegmentPlan, attend_segments, fp32_dot_for, merge_parts, segment_plan
from kernels.triton.tiles import TileConfig, tile_config

if TYPE_CHECKING:
    from kernels.hidden import HiddenBatch


def hidden_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    x: torch.Tensor,
    kv_cache: torch.Tensor,
    hidden: HiddenBatch,
    rebuild: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    tiles: TileConfig | None = None,
) -> None:
    """`kernels.hidden.hidden_attention`'s contract; `tiles` overrides the device's (tests)."""
    tiles = tiles or tile_config(q.device)
    store_hidden(kv_cache, x.index_select(0, hidden.rows), hidden.write_rows)
    k_ctx, v_ctx = k, v  # no context anywhere: the context part's segments are all empty
    if hidden.ctx_rows.numel():
        k_ctx, v_ctx = rebuild(gather_hidden(kv_cache, hidden), *hidden.position_args)
    q, k, v, k_ctx, v_ctx = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, k_ctx, v_ctx))
    heads, head_dim = q.shape[1], q.shape[2]
    context, own = _plans(hidden, heads // k.shape[1], tiles, q.device)
    rows = hidden.rows.shape[0]
    outs = torch.empty(2, rows, heads, head_dim, dtype=torch.float32, device=q.device)
    lses = torch.empty(2, rows, heads, dtype=torch.float32, device=q.device)
    fp32_dot = fp32_dot_for(k.dtype)
    attend_segments(q, k_ctx, v_ctx, context, scale, outs[0], lses[0], tiles, fp32_dot)
    attend_segments(q, k, v, own, scale, outs[1], lses[1], tiles, fp32_dot)
    merged, _ = merge_parts(outs, lses)
    out.index_copy_(0, hidden.rows, merged.to(out.dtype))


def _plans(hidden: HiddenBatch, group: int, tiles: TileConfig, device: torch.device) -> tuple[SegmentPlan, SegmentPlan]:
    """The context and own-token segments of every HIDDEN sequence, built on the first layer."""
    key = ("triton", group, tiles)
    plans = hidden.scratch.get(key)
    if plans is None:
        context, own, row = [], [], 0
        for s in hidden.seqs:
            context.append(Segment(s.q_start, s.q_len, s.ctx_len, s.ctx_start, s.ctx_len, 0, row))
            own.append(Segment(s.q_start, s.q_len, s.ctx_len, s.q_start, s.q_len, s.ctx_len, row))
            row += s.q_len
        plans = hidden.scratch[key] = (
            segment_plan(context, group, tiles, device),
            segment_plan(own, group, tiles, device),
        )
    return plans
