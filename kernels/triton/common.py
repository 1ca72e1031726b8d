"""Triton helpers shared by the attention kernels: paged addressing and the online softmax.

Paged addressing follows the metadata contract of `kernels/attention.py`: logical position
`p` of a sequence lives in table entry `p // block_size` at in-block offset `p % block_size`,
or `block_size - 1 - p % block_size` when that entry's direction bit says *reversed* (BROS:
the block is filled from its right end). A negative entry is a *hole*: a block this kernel
must not read (its tokens take no part in the softmax). Table padding past a sequence's
length is never looked at, whatever it holds.

Softmax runs in base 2 (`exp2`, with log2(e) folded into the score scale), float32 whatever
the cache dtype, with the running maximum kept finite while a row has seen no key yet, so a
tile where every key of a row is masked (a hole, a causal edge, a padding row) adds nothing
instead of NaN.

`FP32_DOT`: float32 caches multiply in IEEE float32 (no TF32: float32 means float32, as in
PyTorch's default), and so does the interpreter for every dtype, because its `tl.dot`
multiplies bfloat16 bit patterns as integers (triton 3.9.0). A bf16 product is exact in
float32, so the interpreter computes what the GPU's bf16 MMA with float32 accumulation does,
up to summation order. On the GPU, bf16/fp16 caches use the tensor cores directly, with the
probabilities rounded to the cache dtype for the second product (as flash attention and the
reference's `probs.to(q.dtype)` do).

"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def paged_offsets(
    table_row, rev_row, pos, in_range, stride_block, stride_slot, BLOCK_SIZE: tl.constexpr, HAS_REV: tl.constexpr
):
    """Element offsets (within one K or V head plane of the cache) of logical positions
    `pos`, and which of them may be read (in range and not in a hole)."""
    logical = pos // BLOCK_SIZE
    block = tl.load(table_row + logical, mask=in_range, other=-1).to(tl.int64)
    offset = pos % BLOCK_SIZE
    if HAS_REV:
        flip = tl.load(rev_row + logical, mask=in_range, other=0)
        offset = tl.where(flip != 0, BLOCK_SIZE - 1 - offset, offset)
    readable = in_range & (block >= 0)
    return block * stride_block + offset.to(tl.int64) * stride_slot, readable


@triton.jit
def scores_of(q, k, scale_log2e, FP32_DOT: tl.constexpr):
    """[rows, D] x [keys, D] -> [rows, keys] float32 scores in base 2."""
    if FP32_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s * scale_log2e


@triton.jit
def softmax_step(scores, v, peak, total, acc, FP32_DOT: tl.constexpr):
    """Fold one tile (scores [rows, keys] with -inf where masked, v [keys, D]) into the running
    maximum `peak`, exponential sum `total` and unnormalised output `acc`."""
    new_peak = tl.maximum(peak, tl.max(scores, 1))
    safe = tl.where(new_peak == float("-inf"), 0.0, new_peak)
    alpha = tl.exp2(peak - safe)
    p = tl.exp2(scores - safe[:, None])
    total = total * alpha + tl.sum(p, 1)
    if FP32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return new_peak, total, acc


@triton.jit
def normalised(acc, total):
    """acc / total per row; a row that saw no key gets zeros (not NaN)."""
    return acc / tl.where(total > 0, total, 1.0)[:, None]
