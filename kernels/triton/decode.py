"""Paged decode attention: one query token per sequence over its whole cached context.

Structure (flash-decoding; compare vLLM's 3D unified attention and SGLang's grouped decode):
- **GQA-grouped programs.** A program owns one (sequence, KV head, split): the `group` query
  heads that share the KV head are the rows of one `tl.dot` (padded to 16), so each K/V tile
  is loaded once for all of them.
- **Split-K.** Each context is cut into `splits` equal parts, rounded to whole tiles, so a
  small batch of long contexts still fills the GPU. With one split the kernel normalises
  and writes the output itself; with more it writes each part's unnormalised output, score
  maximum and exponential sum, and `_merge_splits` combines them exactly:
  out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s, M = max_s m_s.
- **Paged reads** through the block table with BROS direction bits and holes
  (`common.paged_offsets`); each row's length (from the bucket's mask) bounds the reads,
  so the runner's table padding is never read.
"""

import torch
import triton
import triton.language as tl

from kernels.triton.common import LOG2E, normalised, paged_offsets, scores_of, softmax_step
from kernels.triton.plan import DecodePlan
from kernels.triton.tiles import TileConfig


@triton.jit
def _decode_split(
    q_ptr, kv_ptr, out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    rows_ptr, lens_ptr, table_ptr, rev_ptr,
    scale_log2e, num_heads, num_splits,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_kv, stride_kv_head, stride_block, stride_slot, stride_table, stride_rev,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HAS_REV: tl.constexpr, FP32_DOT: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + seq).to(tl.int64)
    seq_len = tl.load(lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE) * TILE
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    head = kv_head * GROUP + g
    row_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    k_plane = kv_ptr + kv_head.to(tl.int64) * stride_kv_head
    v_plane = k_plane + stride_kv
    table_row = table_ptr + seq.to(tl.int64) * stride_table
    rev_row = rev_ptr + seq.to(tl.int64) * stride_rev

    peak = tl.full([G_PAD], float("-inf"), tl.float32)
    total = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for tile in range(start, end, TILE):
        pos = tile + tl.arange(0, TILE)
        offs, readable = paged_offsets(table_row, rev_row, pos, pos < end, stride_block, stride_slot,
                                       BLOCK_SIZE, HAS_REV)  # fmt: skip
        kv_mask = readable[:, None] & d_ok[None, :]
        k = tl.load(k_plane + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = scores_of(q, k, scale_log2e, FP32_DOT)
        scores = tl.where(readable[None, :], scores, float("-inf"))
        v = tl.load(v_plane + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        peak, total, acc = softmax_step(scores, v, peak, total, acc, FP32_DOT)

    if ONE_SPLIT:
        out = normalised(acc, total)
        tl.store(out_ptr + row * stride_o_tok + head[:, None] * stride_o_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip
    else:
        part = (seq.to(tl.int64) * num_heads + head) * num_splits + split
        tl.store(part_max_ptr + part, peak, mask=row_ok)
        tl.store(part_sum_ptr + part, total, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, rows_ptr,
    num_heads, num_splits, stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = tl.load(rows_ptr + seq).to(tl.int64)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < num_splits
    part = (seq * num_heads + head) * num_splits + s
    peak = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))
    total = tl.load(part_sum_ptr + part, mask=s_ok, other=0.0)
    top = tl.max(peak, 0)
    weight = tl.exp2(peak - tl.where(top == float("-inf"), 0.0, top))  # empty splits weigh 0
    denom = tl.sum(weight * total, 0)
    acc = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & (d[None, :] < HEAD_DIM),
                  other=0.0)  # fmt: skip
    out = tl.sum(acc * weight[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + row * stride_o_tok + head * stride_o_head + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)  # fmt: skip


def decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    tiles: TileConfig,
    fp32_dot: bool,
) -> None:
    """Attend the plan's rows of q ([T, heads, D]) over their paged contexts into the same rows of out."""
    seqs = plan.rows.shape[0]
    if seqs == 0:
        return
    heads, head_dim = q.shape[1], q.shape[2]
    _, kv_heads, _, block_size, _ = kv_cache.shape
    group = heads // kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot's minimum K on the GPU
    one = plan.splits == 1
    part_out = out if one else plan.partial_out  # unused pointers when ONE_SPLIT
    part_max = out if one else plan.partial_max
    part_sum = out if one else plan.partial_sum
    rev = plan.reversed if plan.reversed is not None else plan.table
    _decode_split[(seqs, kv_heads, plan.splits)](
        q, kv_cache, out, part_out, part_max, part_sum,
        plan.rows, plan.lens, plan.table, rev,
        scale * LOG2E, heads, plan.splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        plan.table.stride(0), rev.stride(0),
        GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, G_PAD=max(tiles.min_rows, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size, TILE=tiles.decode_tile, HAS_REV=plan.reversed is not None, FP32_DOT=fp32_dot,
        ONE_SPLIT=one, num_warps=tiles.decode_warps, num_stages=tiles.decode_stages,
    )  # fmt: skip
    if not one:
        _merge_splits[(seqs, heads)](
            out, plan.partial_out, plan.partial_max, plan.partial_sum, plan.rows,
            heads, plan.splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad, S_PAD=triton.next_power_of_2(plan.splits),
        )  # fmt: skip
