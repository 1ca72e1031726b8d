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
- Compiled on first use; `warm_up` lets the engine pay that (~20 s with an empty Inductor
  cache, a few seconds with a warm one) before it serves. It compiles in
  inference mode, the mode the engine steps in: Dynamo guards on the grad mode, and a
  graph compiled outside it was recompiled (~1 s) in the engine's first decode step.
- `decode_with_new_math` is the variant traced inside a compiled decoder layer
  (`engine/models/decode_graph.py`): the step's own token is attended from
  the layer's fresh K/V rather than from the cache, so the graph is a pure function and the
  cache is written once for all layers after it.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from kernels.cpu_caps import isolate_compile_cache
from kernels.metadata import DecodeBucket, DecodeChunks

CHUNK_TOKENS = 64  # context tokens per chunk (rounded to whole blocks)


def decode_math(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    chunk_table: torch.Tensor,
    chunk_seq: torch.Tensor,
    chunk_bias: torch.Tensor,
    seq_chunks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [S, heads, D]; kv_cache [2, kv_heads, blocks, bs, D]; chunk_table [C, W] blocks of
    each chunk; chunk_seq [C] its sequence; chunk_bias [C, 1, W * bs] float32 over slots (0
    valid, -inf not); seq_chunks [S, M] each sequence's chunks, padded with C (no chunk).
    Returns [S, heads, D]."""
    qg = _grouped(q, kv_cache.shape[1])
    parts = _chunk_partials(qg, kv_cache, chunk_table, chunk_seq, chunk_bias, seq_chunks, scale)
    return _ungrouped(_combine(*parts), q)


def decode_with_new_math(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    kv_cache: torch.Tensor,
    chunk_table: torch.Tensor,
    chunk_seq: torch.Tensor,
    chunk_bias: torch.Tensor,
    seq_chunks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Like `decode_math`, but the chunks cover only the context *before* this step and the
    step's own token (k_new, v_new [S, kv_heads, D], not yet in the cache) is one more partial.
    Written to be traced inside a compiled decoder layer (models/decode_graph.py), which
    then needs no cache write of its own. A row without context (only "no chunk" entries in
    seq_chunks) is allowed."""
    qg = _grouped(q, kv_cache.shape[1])
    peak, total, partial = _chunk_partials(qg, kv_cache, chunk_table, chunk_seq, chunk_bias, seq_chunks, scale)
    own = (qg * k_new.transpose(0, 1).unsqueeze(2).float()).sum(-1) * scale  # [kvh, S, g]
    own_value = v_new.transpose(0, 1).unsqueeze(2).float().expand_as(partial[:, :, 0])  # [kvh, S, g, D]
    peak = torch.cat((peak, own.unsqueeze(2)), 2)
    total = torch.cat((total, torch.ones_like(own).unsqueeze(2)), 2)
    partial = torch.cat((partial, own_value.unsqueeze(2)), 2)
    return _ungrouped(_combine(peak, total, partial), q)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[S, heads, D] -> float32 [kvh, S, g, D]: the query heads that share a KV head together."""
    seqs, heads, head_dim = q.shape
    return q.view(seqs, kv_heads, heads // kv_heads, head_dim).transpose(0, 1).float()


def _ungrouped(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return out.transpose(0, 1).reshape(q.shape).to(q.dtype)


def _chunk_partials(qg, kv_cache, chunk_table, chunk_seq, chunk_bias, seq_chunks, scale):
    """Each chunk's score maximum, sum of exponentials and unnormalised output, gathered per
    sequence: [kvh, S, M, g], [kvh, S, M, g], [kvh, S, M, g, D]."""
    qc = qg[:, chunk_seq]  # [kvh, C, g, D]
    keys = kv_cache[0][:, chunk_table].flatten(2, 3)  # [kvh, C, L, D]: indexing Inductor folds into loads
    values = kv_cache[1][:, chunk_table].flatten(2, 3)
    scores = (qc.unsqueeze(3) * keys.unsqueeze(2).float()).sum(-1) * scale + chunk_bias  # [kvh, C, g, L]
    peak = scores.amax(-1)  # [kvh, C, g]; every chunk has a valid slot, so finite
    probs = torch.exp(scores - peak.unsqueeze(-1))
    total = probs.sum(-1)
    partial = (probs.unsqueeze(-1) * values.unsqueeze(2).float()).sum(3)  # [kvh, C, g, D], unnormalised
    # index C is "no chunk": peak -inf, so its weight in _combine is 0
    peak = F.pad(peak, (0, 0, 0, 1), value=float("-inf"))[:, seq_chunks]  # [kvh, S, M, g]
    total, partial = F.pad(total, (0, 0, 0, 1))[:, seq_chunks], F.pad(partial, (0, 0, 0, 0, 0, 1))[:, seq_chunks]
    return peak, total, partial


def _combine(peak: torch.Tensor, total: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
    """Softmax-weighted merge of each sequence's partials over dim 2 -> [kvh, S, g, D]."""
    weight = torch.exp(peak - peak.amax(2, keepdim=True))
    return (partial * weight.unsqueeze(-1)).sum(2) / (total * weight).sum(2).unsqueeze(-1)


@functools.cache
def _compiled(static: tuple):
    """The compiled kernel for one static configuration (dtype, head counts, head and block size)."""
    return compile_copy(decode_math, "decode_math", static)


def compile_copy(fn, prefix: str, static: tuple):
    """`torch.compile` of a copy of `fn` with its own code object, hence its own Dynamo cache.

    One copy per static configuration: a process that loads several models (the test suite
    does) never reaches Dynamo's per-code-object recompile limit, which with
    `fullgraph=True` is an error."""
    isolate_compile_cache()
    name = prefix + "_" + "_".join(str(x) for x in static).replace("torch.", "").replace(":", "")
    code = fn.__code__.replace(co_name=name)  # a stable name keeps Inductor's disk cache warm
    copy = types.FunctionType(code, fn.__globals__, code.co_name)
    return torch.compile(copy, dynamic=False, fullgraph=True)


def chunk_blocks(block_size: int) -> int:
    return max(1, CHUNK_TOKENS // block_size)


def graph_chunks(c: DecodeChunks, seqs: int) -> tuple[torch.Tensor, ...]:
    """(table, seq, bias, seq_chunks) of `c` as a compiled graph takes them: Dynamo
    specialises sizes 0 and 1, so a lone chunk gets an unreferenced twin, a lone chunk
    column a "no chunk" column, and `seqs` (2 when the caller doubled a lone sequence)
    rows of seq_chunks; chunk, sequence and column counts are marked dynamic."""
    table, seq, bias, seq_chunks = c.table, c.seq, c.bias, c.seq_chunks
    if seq_chunks.shape[0] < seqs:  # the same sequence twice; the copy's output is dropped
        seq_chunks = seq_chunks.expand(seqs, -1)
    if table.shape[0] == 1:
        table, seq, bias = table.expand(2, -1), seq.expand(2), bias.expand(2, -1, -1)
    if seq_chunks.shape[1] == 1:
        seq_chunks = F.pad(seq_chunks, (0, 1), value=table.shape[0])
    tensors = tuple(t.contiguous() for t in (table, seq, bias, seq_chunks))
    for t, dims in zip(tensors, ((0,), (0,), (0,), (0, 1))):
        for d in dims:
            torch._dynamo.mark_dynamic(t, d)
    return tensors


def decode(q: torch.Tensor, kv_cache: torch.Tensor, bucket: DecodeBucket, scale: float) -> torch.Tensor:
    """Attention of one decode bucket (same contract as the reference `_decode`); a bucket
    may hold sequences of any lengths."""
    seqs = q.shape[0]
    if seqs == 1:  # Dynamo specialises size 1: the same sequence twice
        q = q.expand(2, -1, -1)
    chunks = graph_chunks(bucket.chunks(chunk_blocks(kv_cache.shape[3])), q.shape[0])
    q = q.contiguous()
    torch._dynamo.mark_dynamic(q, 0)
    torch._dynamo.mark_dynamic(kv_cache, 2)
    static = (q.dtype, q.shape[1], kv_cache.shape[1], *kv_cache.shape[3:], chunks[0].shape[1], str(q.device))
    return _compiled(static)(q, kv_cache, *chunks, scale)[:seqs]


@torch.inference_mode()  # the mode the engine runs in; a graph compiled outside it would recompile
def warm_up(kv_cache: torch.Tensor, num_heads: int, scale: float) -> None:
    """Compile for this cache's shape and dtype now, on a dummy bucket over the null block."""
    bucket = warm_up_bucket(kv_cache.shape[3], kv_cache.device)
    decode(torch.zeros(2, num_heads, kv_cache.shape[4], dtype=kv_cache.dtype), kv_cache, bucket, scale)


def warm_up_bucket(block_size: int, device: torch.device) -> DecodeBucket:
    """Two sequences of three chunks each over the null block 0: no size-1 dimension."""
    width = 2 * chunk_blocks(block_size) + 1
    return DecodeBucket(
        rows=torch.arange(2, device=device),
        block_table=torch.zeros(2, width, dtype=torch.long, device=device),
        bias=torch.zeros(2, 1, width * block_size, device=device),
    )
