"""Decode attention written for Inductor: the block gather fused into the attention loops.

The reference path (`kernels/reference/attention.py`) copies a bucket's K/V blocks into a
padded buffer and runs two batched matmuls. On CPU that is a third of a decode step: every
K/V row is read from DRAM, written to the buffer and read again, and the matmuls are tiny
(one query row per head). Written instead as a broadcast multiply-and-sum over
`kv_cache[:, block_table]`, the same math compiles (`torch.compile`, Inductor's C++
backend) to OpenMP loop nests that read each K/V row once, straight from the pool, with the
block-table lookup in the load's address. The source stays plain PyTorch; Inductor writes
the loops.

The work is split into *chunks* of `CHUNK_TOKENS` consecutive context tokens (split-K, as
in flash-decoding): every chunk yields its score maximum, its sum of exponentials and its
unnormalised output, and each sequence then combines its chunks' partials. All decode
sequences of a step go through one call per layer whatever their lengths: padding is at
most one partial chunk per sequence, instead of padding a batch to its longest member
(or paying a call, with its ~60-100 µs of Python and guard overhead, per length bucket).

Decisions:
- Keys are visited in *slot* order. A reversed (BROS) block is not flipped back; the
  bucket's mask is flipped instead (`DecodeBucket.slot_bias`). Softmax attention does not
  depend on the order of its keys; only the float summation order differs from the
  reference, so results agree to rounding, not bit for bit.
- One compiled graph serves every step and every pool size: sequence, chunk and pool
  block counts are marked dynamic, and sizes 0/1 (which Dynamo specialises) are padded
  away: a lone sequence is doubled, a lone chunk gets an unreferenced twin.
- Scores and softmax are float32 whatever the cache dtype, as in the reference.
- Compiled on first use; `warm_up` lets the engine pay that (~10 s the first time on a
  machine, a few seconds from Inductor's on-disk cache) before it serves.
"""
from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kernels.attention import DecodeBucket, DecodeChunks

CHUNK_TOKENS = 64  # context tokens per chunk (rounded to whole blocks)


def decode_math(q: torch.Tensor, kv_cache: torch.Tensor, chunk_table: torch.Tensor, chunk_seq: torch.Tensor,
                chunk_bias: torch.Tensor, seq_chunks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [S, heads, D]; kv_cache [2, kv_heads, blocks, bs, D]; chunk_table [C, W] blocks of
    each chunk; chunk_seq [C] its sequence; chunk_bias [C, 1, W * bs] float32 over slots (0
    valid, -inf not); seq_chunks [S, M] each sequence's chunks, padded with C (no chunk).
    Returns [S, heads, D]."""
    seqs, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[1]
    chunks = chunk_table.shape[0]
    qc = q[chunk_seq].view(chunks, kv_heads, heads // kv_heads, head_dim).transpose(0, 1).float()  # [kvh, C, g, D]
    keys = kv_cache[0][:, chunk_table].flatten(2, 3)  # [kvh, C, L, D]: indexing Inductor folds into loads
    values = kv_cache[1][:, chunk_table].flatten(2, 3)
    scores = (qc.unsqueeze(3) * keys.unsqueeze(2).float()).sum(-1) * scale + chunk_bias  # [kvh, C, g, L]
    peak = scores.amax(-1)  # [kvh, C, g]; every chunk has a valid slot, so finite
    probs = torch.exp(scores - peak.unsqueeze(-1))
    total = probs.sum(-1)
    partial = (probs.unsqueeze(-1) * values.unsqueeze(2).float()).sum(3)  # [kvh, C, g, D], unnormalised
    # index C is "no chunk": peak -inf, so its weight below is 0
    peak = F.pad(peak, (0, 0, 0, 1), value=float("-inf"))[:, seq_chunks]  # [kvh, S, M, g]
    total, partial = F.pad(total, (0, 0, 0, 1))[:, seq_chunks], F.pad(partial, (0, 0, 0, 0, 0, 1))[:, seq_chunks]
    weight = torch.exp(peak - peak.amax(2, keepdim=True))
    out = (partial * weight.unsqueeze(-1)).sum(2) / (total * weight).sum(2).unsqueeze(-1)  # [kvh, S, g, D]
    return out.transpose(0, 1).reshape(seqs, heads, head_dim).to(q.dtype)


@functools.cache
def _compiled(static: tuple):
    """The compiled kernel for one static configuration (dtype, head counts, head and block size).

    Each gets a copy of `decode_math` with its own code object, hence its own Dynamo cache:
    a process that loads several models (the test suite does) never reaches Dynamo's
    per-code-object recompile limit, which with `fullgraph=True` is an error."""
    name = "decode_math_" + "_".join(str(x) for x in static).replace("torch.", "").replace(":", "")
    code = decode_math.__code__.replace(co_name=name)  # a stable name keeps Inductor's disk cache warm
    fn = types.FunctionType(code, decode_math.__globals__, code.co_name)
    return torch.compile(fn, dynamic=False, fullgraph=True)


def chunk_blocks(block_size: int) -> int:
    return max(1, CHUNK_TOKENS // block_size)


def decode(q: torch.Tensor, kv_cache: torch.Tensor, bucket: "DecodeBucket", scale: float) -> torch.Tensor:
    """Attention of one decode bucket (same contract as the reference `_decode`); a bucket
    may hold sequences of any lengths."""
    c: DecodeChunks = bucket.chunks(chunk_blocks(kv_cache.shape[3]))
    seqs = q.shape[0]
    table, seq, bias, seq_chunks = c.table, c.seq, c.bias, c.seq_chunks
    if seqs == 1:  # the same sequence twice; the copy's output is dropped
        q, seq_chunks = q.expand(2, -1, -1), seq_chunks.expand(2, -1)
    if table.shape[0] == 1:  # an unreferenced twin chunk
        table, seq, bias = table.expand(2, -1), seq.expand(2), bias.expand(2, -1, -1)
    if seq_chunks.shape[1] == 1:  # a "no chunk" column
        seq_chunks = F.pad(seq_chunks, (0, 1), value=table.shape[0])
    q, table, seq, bias, seq_chunks = (t.contiguous() for t in (q, table, seq, bias, seq_chunks))
    for t, dims in ((q, (0,)), (kv_cache, (2,)), (table, (0,)), (seq, (0,)), (bias, (0,)), (seq_chunks, (0, 1))):
        for d in dims:
            torch._dynamo.mark_dynamic(t, d)
    static = (q.dtype, q.shape[1], kv_cache.shape[1], *kv_cache.shape[3:], table.shape[1], str(q.device))
    return _compiled(static)(q, kv_cache, table, seq, bias, seq_chunks, scale)[:seqs]


def warm_up(kv_cache: torch.Tensor, num_heads: int, scale: float) -> None:
    """Compile for this cache's shape and dtype now, on a dummy bucket over the null block."""
    from kernels.attention import DecodeBucket

    bs, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    width = 2 * chunk_blocks(bs) + 1  # three chunks per sequence: no size-1 dimension
    bucket = DecodeBucket(rows=torch.arange(2), block_table=torch.zeros(2, width, dtype=torch.long),
                          bias=torch.zeros(2, 1, width * bs))
    decode(torch.zeros(2, num_heads, head_dim, dtype=kv_cache.dtype), kv_cache, bucket, scale)
