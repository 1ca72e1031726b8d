"""Decode attention written for Inductor: the block gather fused into the attention loops.

The reference path (`kernels/reference/attention.py`) copies a bucket's K/V blocks into a
padded buffer and runs two batched matmuls. On CPU that is a third of a decode step: every
K/V row is read from DRAM, written to the buffer and read again, and the matmuls are tiny
(one query row per head). Written instead as a broadcast multiply-and-sum over
`kv_cache[:, block_table]`, the same math compiles (`torch.compile`, Inductor's C++
backend) to one OpenMP loop nest per phase that reads each K/V row once, straight from
the pool, with the block-table lookup in the load's address. The source stays plain
PyTorch; Inductor writes the loops.

Decisions:
- Keys are visited in *slot* order. A reversed (BROS) block is not flipped back; the
  bucket's mask is flipped instead (`DecodeBucket.slot_bias`). Softmax attention does not
  depend on the order of its keys; only the float summation order differs from the
  reference, so results agree to rounding, not bit for bit.
- One compiled graph serves every step and every pool size: the sequence, block-table and
  pool block counts are marked dynamic,
  and a bucket with one sequence or one block is padded to two (Dynamo specialises sizes
  0 and 1, and a recompile costs seconds in the middle of serving).
- Scores and softmax are float32 whatever the cache dtype, as in the reference.
- Compiled on first use; `warm_up` lets the engine pay that (~10 s the first time on a
  machine, a second or two from Inductor's on-disk cache) before it serves.
"""
from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kernels.attention import DecodeBucket


def decode_math(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, bias: torch.Tensor,
                scale: float) -> torch.Tensor:
    """q [B, heads, D]; kv_cache [2, kv_heads, blocks, bs, D]; block_table [B, n];
    bias [B, 1, n * bs] float32 over slots (0 valid, -inf not). Returns [B, heads, D]."""
    batch, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[1]
    qg = q.view(batch, kv_heads, heads // kv_heads, head_dim).transpose(0, 1).float()  # [kvh, B, g, D]
    keys = kv_cache[0][:, block_table].flatten(2, 3)  # [kvh, B, L, D]: indexing Inductor folds into loads
    values = kv_cache[1][:, block_table].flatten(2, 3)
    scores = (qg.unsqueeze(3) * keys.unsqueeze(2).float()).sum(-1) * scale + bias  # [kvh, B, g, L]
    probs = torch.softmax(scores, dim=-1)
    out = (probs.unsqueeze(-1) * values.unsqueeze(2).float()).sum(3)  # [kvh, B, g, D]
    return out.transpose(0, 1).reshape(batch, heads, head_dim).to(q.dtype)


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


def decode(q: torch.Tensor, kv_cache: torch.Tensor, bucket: "DecodeBucket", scale: float) -> torch.Tensor:
    """Attention of one decode bucket (same contract as the reference `_decode`)."""
    table, bias = bucket.block_table, bucket.slot_bias()
    batch = q.shape[0]
    if table.shape[1] == 1:  # a null block (0) more, fully masked
        table = F.pad(table, (0, 1))
        bias = F.pad(bias, (0, kv_cache.shape[3]), value=float("-inf"))
    if batch == 1:  # the same sequence twice; the copy's output is dropped
        q, table, bias = q.expand(2, -1, -1), table.expand(2, -1), bias.expand(2, -1, -1)
    q, table, bias = q.contiguous(), table.contiguous(), bias.contiguous()
    for t, dims in ((q, (0,)), (kv_cache, (2,)), (table, (0, 1)), (bias, (0, 2))):
        for d in dims:
            torch._dynamo.mark_dynamic(t, d)
    static = (q.dtype, q.shape[1], kv_cache.shape[1], *kv_cache.shape[3:], str(q.device))
    return _compiled(static)(q, kv_cache, table, bias, scale)[:batch]


def warm_up(kv_cache: torch.Tensor, num_heads: int, scale: float) -> None:
    """Compile for this cache's shape and dtype now, on a dummy bucket over the null block."""
    from kernels.attention import DecodeBucket

    bs, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    bucket = DecodeBucket(rows=torch.arange(2), block_table=torch.zeros(2, 2, dtype=torch.long),
                          bias=torch.zeros(2, 1, 2 * bs))
    decode(torch.zeros(2, num_heads, head_dim, dtype=kv_cache.dtype), kv_cache, bucket, scale)
