"""Paged prefill/extend attention: a chunk of new tokens over its cached prefix and itself.

A prefill span (`PrefillSpan`) brings `q_len` new tokens of a sequence that already has
`ctx_len` tokens in the cache. Each new token attends to the whole prefix (read from the
paged cache through the span's block list, BROS directions and holes as in decode) and,
causally, to the new tokens up to itself (read from this step's contiguous k and v, as
SGLang's extend kernel does, rather than from the cache: a first chunk has no block list
in the metadata, and the rows are already in registers' reach).

Programs: one per (query tile, KV head). A tile's rows are `tokens_per_tile` consecutive
new tokens times the `group` query heads of the KV head (vLLM's packing: row r is token
r // group, head r % group), so GQA loads each K/V tile once for the whole group and the
`tl.dot` has >= 16 rows whatever the group. The tile list (span and first token of each
program) is built on the host once per step (`plan.ExtendPlan`). No split-K here: a prefill
step has many query tiles, which already fill the GPU.

For eLLM's partially resident sequences (`resident.py`) the same kernel reads from a span's
first resident position (`kv_from`, 0 for every ordinary span), writes to its own rows of a
compact buffer (`o_start`, q_start otherwise) and, with `WITH_LSE`, each row's log-sum-exp,
so its result is a part to merge with the rebuilt prefix's.
"""

import torch
import triton
import triton.language as tl

from kernels.triton.common import LOG2E, normalised, paged_offsets, scores_of, softmax_step
from kernels.triton.plan import ExtendPlan
from kernels.triton.tiles import TileConfig


@triton.jit
def _extend(
    q_ptr, k_ptr, v_ptr, kv_ptr, out_ptr,
    tile_span_ptr, tile_first_ptr, q_start_ptr, q_len_ptr, ctx_len_ptr, kv_from_ptr, o_start_ptr, table_ptr, rev_ptr,
    lse_ptr, scale_log2e, num_heads,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_o_tok, stride_o_head,
    stride_kv, stride_kv_head, stride_block, stride_slot, stride_table, stride_rev,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HAS_REV: tl.constexpr, FP32_DOT: tl.constexpr,
    WITH_LSE: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    span = tl.load(tile_span_ptr + program)
    first = tl.load(tile_first_ptr + program)
    q_start = tl.load(q_start_ptr + span).to(tl.int64)
    q_len = tl.load(q_len_ptr + span)
    ctx_len = tl.load(ctx_len_ptr + span)
    kv_from = tl.load(kv_from_ptr + span)  # first key position to attend (eLLM: the first resident one)
    o_start = tl.load(o_start_ptr + span).to(tl.int64)

    r = tl.arange(0, ROWS)
    d = tl.arange(0, D_PAD)
    tok = first + r // GROUP  # new-token index within the span
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < TOKENS * GROUP) & (tok < q_len)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip

    peak = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)

    # the cached prefix from kv_from on: every position precedes every new token, so no causal mask
    k_plane = kv_ptr + kv_head.to(tl.int64) * stride_kv_head
    v_plane = k_plane + stride_kv
    table_row = table_ptr + span.to(tl.int64) * stride_table
    rev_row = rev_ptr + span.to(tl.int64) * stride_rev
    for tile in range(kv_from, ctx_len, TILE):
        pos = tile + tl.arange(0, TILE)
        offs, readable = paged_offsets(table_row, rev_row, pos, pos < ctx_len, stride_block, stride_slot,
                                       BLOCK_SIZE, HAS_REV)  # fmt: skip
        kv_mask = readable[:, None] & d_ok[None, :]
        k = tl.load(k_plane + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.where(readable[None, :], scores_of(q, k, scale_log2e, FP32_DOT), float("-inf"))
        v = tl.load(v_plane + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        peak, total, acc = softmax_step(scores, v, peak, total, acc, FP32_DOT)

    # the new tokens, causally: token i sees new tokens 0..i (those at positions >= kv_from)
    last = tl.minimum(q_len, first + TOKENS)
    for tile in range(tl.maximum(kv_from - ctx_len, 0), last, TILE):
        j = tile + tl.arange(0, TILE)
        j_ok = j < last
        kv_mask = j_ok[:, None] & d_ok[None, :]
        src = (q_start + j)[:, None]
        k = tl.load(k_ptr + src * stride_k_tok + kv_head * stride_k_head + d[None, :], mask=kv_mask, other=0.0)
        visible = j_ok[None, :] & (j[None, :] <= tok[:, None])
        scores = tl.where(visible, scores_of(q, k, scale_log2e, FP32_DOT), float("-inf"))
        v = tl.load(v_ptr + src * stride_v_tok + kv_head * stride_v_head + d[None, :], mask=kv_mask, other=0.0)
        peak, total, acc = softmax_step(scores, v, peak, total, acc, FP32_DOT)

    out = normalised(acc, total)
    out_row = o_start + tok
    tl.store(out_ptr + out_row[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip
    if WITH_LSE:  # natural-log log-sum-exp, -inf for a row that saw no key (kernels/reference/partial.py)
        seen = total > 0
        lse = tl.where(seen, (peak + tl.log2(tl.where(seen, total, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + out_row * num_heads + head, lse, mask=row_ok)


def extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    plan: ExtendPlan,
    scale: float,
    tiles: TileConfig,
    fp32_dot: bool,
    lse: torch.Tensor | None = None,
) -> None:
    """Attend every prefill span's rows of q into its output rows of out (k, v: [T, kv_heads,
    D]); with `lse` (`[rows of out, heads]`, contiguous) also each row's log-sum-exp, so the
    result is a part to merge (eLLM's paged suffix, kernels/triton/resident.py)."""
    programs = plan.tile_span.shape[0]
    if programs == 0:
        return
    heads, head_dim = q.shape[1], q.shape[2]
    _, kv_heads, _, block_size, _ = kv_cache.shape
    group = heads // kv_heads
    rows = max(tiles.min_rows, triton.next_power_of_2(plan.tokens_per_tile * group))
    rev = plan.reversed if plan.reversed is not None else plan.table
    _extend[(programs, kv_heads)](
        q, k, v, kv_cache, out,
        plan.tile_span, plan.tile_first, plan.q_start, plan.q_len, plan.ctx_len, plan.kv_from, plan.o_start,
        plan.table, rev, out if lse is None else lse, scale * LOG2E, heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        plan.table.stride(0), rev.stride(0),
        GROUP=group, TOKENS=plan.tokens_per_tile, ROWS=rows, HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, TILE=tiles.extend_tile,
        HAS_REV=plan.reversed is not None, FP32_DOT=fp32_dot, WITH_LSE=lse is not None,
        num_warps=tiles.extend_warps, num_stages=tiles.extend_stages,
    )  # fmt: skip
