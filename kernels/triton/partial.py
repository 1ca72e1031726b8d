"""Partial attention with its log-sum-exp, and the exact merge of parts: the Triton form of
`kernels/reference/partial.py` (`attend_partial`, `merge_partials`), the contract for K/V
that are not in the paged pool (the hybrid cache's rebuilt K/V, eLLM's rebuilt prefix).

- `attend_segments` attends many *segments* in one launch. A segment is a run of query rows
  (absolute positions `q_pos0 ..`) over a run of rows of a dense K/V tensor (positions
  `k_pos0 ..`), causal by absolute position, and writes the part's float32 normalised output
  and natural-log log-sum-exp at its own output rows (`o_start ..`), so the parts of a step
  land in one compact buffer ready for the merge. A row that sees no key gets output 0 and
  lse -inf, as in the reference. Programs: one per (segment query tile, KV head), rows =
  tokens x the group's query heads (the packing of `extend.py`), so GQA loads each K/V tile
  once per group and `tl.dot` has >= 16 rows whatever the group. Each program stops at the
  last key its last token may see (keys after every query of the tile are never loaded).
- `merge_parts` combines `P` parts stacked as `[P, rows, heads, D]` / `[P, rows, heads]`
  with an online log-sum-exp over the parts (one pass, no second read): the merged output
  is `sum_i exp(lse_i - L) out_i` with `L = logsumexp_i lse_i`, empty parts weigh zero.

Outputs stay float32 (the reference's contract: merging never loses precision to bf16); the
caller casts the merged rows. Under the interpreter every product is float32 (see `common`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton.common import LOG2E, normalised, scores_of, softmax_step
from kernels.triton.tiles import TileConfig, tile_config


@dataclass(frozen=True)
class Segment:
    """Query rows `q_start .. q_start+q_len` (positions `q_pos0 ..`) over K/V rows `k_start ..
    k_start+k_len` (positions `k_pos0 ..`); the output goes to rows `o_start ..`."""

    q_start: int
    q_len: int
    q_pos0: int
    k_start: int
    k_len: int
    k_pos0: int
    o_start: int


@dataclass(frozen=True)
class SegmentPlan:
    """Segments in the kernel's form (int32 device tensors), and its programs' tile list."""

    fields: torch.Tensor  # [7, S] the Segment fields, in declaration order
    tile_seg: torch.Tensor  # [N] segment of each program
    tile_first: torch.Tensor  # [N] its first query token within the segment
    tokens_per_tile: int


def segment_plan(segments: Sequence[Segment], group: int, tiles: TileConfig, device: torch.device) -> SegmentPlan:
    """Built on the host once per step (the engine reuses it for every layer)."""
    per_tile = max(1, tiles.extend_rows // group)
    tile_seg, tile_first = [], []
    for i, s in enumerate(segments):
        for first in range(0, s.q_len, per_tile):
            tile_seg.append(i)
            tile_first.append(first)
    rows = [[getattr(s, f) for s in segments] for f in Segment.__dataclass_fields__]
    fields = torch.tensor(rows, dtype=torch.int32).reshape(7, len(segments)).to(device)
    tile_list = torch.tensor([tile_seg, tile_first], dtype=torch.int32).reshape(2, -1).to(device)
    return SegmentPlan(fields, tile_list[0], tile_list[1], per_tile)


@triton.jit
def _attend_segments(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, fields_ptr, tile_seg_ptr, tile_first_ptr,
    scale_log2e, num_segments, num_heads,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_o_tok, stride_o_head,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    TILE: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg = tl.load(tile_seg_ptr + program)
    first = tl.load(tile_first_ptr + program)
    q_start = tl.load(fields_ptr + seg).to(tl.int64)
    q_len = tl.load(fields_ptr + num_segments + seg)
    q_pos0 = tl.load(fields_ptr + 2 * num_segments + seg)
    k_start = tl.load(fields_ptr + 3 * num_segments + seg).to(tl.int64)
    k_len = tl.load(fields_ptr + 4 * num_segments + seg)
    k_pos0 = tl.load(fields_ptr + 5 * num_segments + seg)
    o_start = tl.load(fields_ptr + 6 * num_segments + seg).to(tl.int64)

    r = tl.arange(0, ROWS)
    d = tl.arange(0, D_PAD)
    tok = first + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < TOKENS * GROUP) & (tok < q_len)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    q_pos = q_pos0 + tok

    peak = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    # keys j with k_pos0 + j <= the tile's last query position; none past k_len
    last_pos = q_pos0 + tl.minimum(q_len, first + TOKENS) - 1
    hi = tl.maximum(tl.minimum(k_len, last_pos - k_pos0 + 1), 0)
    for tile in range(0, hi, TILE):
        j = tile + tl.arange(0, TILE)
        j_ok = j < hi
        kv_mask = j_ok[:, None] & d_ok[None, :]
        src = (k_start + j)[:, None]
        k = tl.load(k_ptr + src * stride_k_tok + kv_head * stride_k_head + d[None, :], mask=kv_mask, other=0.0)
        visible = j_ok[None, :] & ((k_pos0 + j)[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores_of(q, k, scale_log2e, FP32_DOT), float("-inf"))
        v = tl.load(v_ptr + src * stride_v_tok + kv_head * stride_v_head + d[None, :], mask=kv_mask, other=0.0)
        peak, total, acc = softmax_step(scores, v, peak, total, acc, FP32_DOT)

    out_row = o_start + tok
    tl.store(out_ptr + out_row[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :],
             normalised(acc, total), mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip
    lse = tl.where(
        total > 0, (peak + tl.log2(tl.where(total > 0, total, 1.0))) * 0.6931471805599453, float("-inf")
    )  # ln 2
    tl.store(lse_ptr + out_row * num_heads + head, lse, mask=row_ok)


def attend_segments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: SegmentPlan,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    tiles: TileConfig,
    fp32_dot: bool,
) -> None:
    """Every segment of `plan`: q `[Tq, heads, D]` over k, v `[Tk, kv_heads, D]` into the
    float32 `out` `[R, heads, D]` (head_dim contiguous) and `lse` `[R, heads]` (contiguous)."""
    programs = plan.tile_seg.shape[0]
    if programs == 0:
        return
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
    group = heads // kv_heads
    rows = max(tiles.min_rows, triton.next_power_of_2(plan.tokens_per_tile * group))
    _attend_segments[(programs, kv_heads)](
        q, k, v, out, lse, plan.fields, plan.tile_seg, plan.tile_first,
        scale * LOG2E, plan.fields.shape[1], heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, TOKENS=plan.tokens_per_tile, ROWS=rows, HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)), TILE=tiles.extend_tile, FP32_DOT=fp32_dot,
        num_warps=tiles.extend_warps, num_stages=tiles.extend_stages,
    )  # fmt: skip


@triton.jit
def _merge_parts(
    outs_ptr, lses_ptr, out_ptr, lse_ptr, num_parts, entries,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (row, head) entries
    d = tl.arange(0, D_PAD)
    n_ok = n < entries
    mask = n_ok[:, None] & (d[None, :] < HEAD_DIM)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, D_PAD], tl.float32)
    for p in range(num_parts):
        part = p * entries + n
        lse = tl.load(lses_ptr + part, mask=n_ok, other=float("-inf"))
        new_top = tl.maximum(top, lse)
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        alpha = tl.exp(top - safe)
        weight = tl.exp(lse - safe)  # 0 for a part the entry does not see
        o = tl.load(outs_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        denom = denom * alpha + weight
        acc = acc * alpha[:, None] + weight[:, None] * o
        top = new_top
    seen = denom > 0
    tl.store(out_ptr + n[:, None] * HEAD_DIM + d[None, :], acc / tl.where(seen, denom, 1.0)[:, None], mask=mask)
    merged = tl.where(seen, top + tl.log(tl.where(seen, denom, 1.0)), float("-inf"))
    tl.store(lse_ptr + n, merged, mask=n_ok)


def merge_parts(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge `outs` `[P, rows, heads, D]` and `lses` `[P, rows, heads]` (float32, contiguous)
    into `(out [rows, heads, D], lse [rows, heads])`, float32."""
    if outs.shape[0] == 0:
        raise ValueError("merge_partials needs at least one part")
    parts, rows, heads, head_dim = outs.shape
    out = torch.empty(rows, heads, head_dim, dtype=torch.float32, device=outs.device)
    lse = torch.empty(rows, heads, dtype=torch.float32, device=outs.device)
    entries = rows * heads
    if entries:
        block = 16
        _merge_parts[(triton.cdiv(entries, block),)](
            outs.contiguous(), lses.contiguous(), out, lse, parts, entries,
            HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), BLOCK=block,
        )  # fmt: skip
    return out, lse


# -- the reference's single-part calls, for tests and callers with one segment ------------


def fp32_dot_for(dtype: torch.dtype) -> bool:
    """Products in IEEE float32: for float32 inputs, and for every dtype under the interpreter."""
    from kernels.triton import INTERPRETED

    return INTERPRETED or dtype == torch.float32


def attend_partial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_pos0: int,
    k_pos0: int,
    scale: float,
    tiles: TileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.reference.partial.attend_partial`'s contract, on the Triton kernel."""
    tiles = tiles or tile_config(q.device)
    q_len, heads, head_dim = q.shape
    segment = Segment(0, q_len, q_pos0, 0, k.shape[0], k_pos0, 0)
    plan = segment_plan([segment], max(1, heads // k.shape[1]), tiles, q.device)
    out = torch.zeros(q_len, heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((q_len, heads), float("-inf"), dtype=torch.float32, device=q.device)
    attend_segments(q, k, v, plan, scale, out, lse, tiles, fp32_dot_for(k.dtype))
    return out, lse


def merge_partials(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.reference.partial.merge_partials`'s contract, on the Triton kernel."""
    if not parts:
        raise ValueError("merge_partials needs at least one part")
    return merge_parts(torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]))
