"""The Inductor-compiled decode attention (kernels/compiled/decode.py) against the reference
and against dense attention over the logical keys: GQA and MHA, float32 and bfloat16,
reversed (BROS) blocks, the one-sequence / one-block padding, and one compiled graph for
every batch shape and pool size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.compiled import decode as compiled
from kernels.metadata import DecodeBucket
from kernels.reference.attention import _decode as reference_decode
from tests.conftest import requires_cxx

pytestmark = requires_cxx


def _bucket(kv_cache, lengths, *, reversed_share=0.0, seed=0):
    """Random K/V for sequences of `lengths`, written into random distinct blocks (a reversed
    block holds logical offset o at slot bs-1-o). Returns the bucket and the logical K/V."""
    gen = torch.Generator().manual_seed(seed)
    _, kv_heads, num_blocks, bs, dim = kv_cache.shape
    width = max(-(-n // bs) for n in lengths)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(lengths), width, dtype=torch.long)
    rev = torch.zeros(len(lengths), width, dtype=torch.bool)
    logical = []
    for i, n in enumerate(lengths):
        kv = torch.randn(2, kv_heads, n, dim, generator=gen).to(kv_cache.dtype)
        logical.append(kv)
        for b in range(-(-n // bs)):
            block = free.pop()
            table[i, b] = block
            rev[i, b] = bool(torch.rand((), generator=gen) < reversed_share)
            chunk = kv[:, :, b * bs : (b + 1) * bs]
            slots = torch.arange(chunk.shape[2])
            if rev[i, b]:
                slots = bs - 1 - slots
            kv_cache[:, :, block, slots] = chunk
    valid = torch.arange(width * bs).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf")).unsqueeze(1)
    bucket = DecodeBucket(
        rows=torch.arange(len(lengths)), block_table=table, bias=bias, reversed=rev if rev.any() else None
    )
    return bucket, logical


def _dense(q, logical, scale):
    """Per-sequence float64 attention of one query row per head over its logical K/V."""
    out = []
    heads = q.shape[1]
    for qi, kv in zip(q.double(), logical):
        k, v = kv.double().repeat_interleave(heads // kv.shape[1], dim=1)
        probs = torch.softmax((k @ qi.unsqueeze(-1)).squeeze(-1) * scale, dim=-1)  # [heads, n]
        out.append((probs.unsqueeze(-1) * v).sum(1))
    return torch.stack(out)


def _cache(kv_heads, blocks, bs, dim, dtype):
    return torch.zeros(2, kv_heads, blocks, bs, dim, dtype=dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim,bs", [(9, 3, 64, 16), (4, 4, 16, 4), (8, 2, 32, 8)])
@pytest.mark.parametrize("lengths", [[1], [5], [37, 3, 20, 64, 9], [16, 16], [200, 150, 181]])
def test_matches_reference_and_dense(dtype, tol, heads, kv_heads, dim, bs, lengths):
    cache = _cache(kv_heads, 160, bs, dim, dtype)
    bucket, logical = _bucket(cache, lengths)
    q = torch.randn(len(lengths), heads, dim).to(dtype)
    scale = dim**-0.5
    got = compiled.decode(q, cache, bucket, scale)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), reference_decode(q, cache, bucket, scale).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), _dense(q, logical, scale), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_reversed_blocks_read_in_place(dtype, tol):
    """BROS blocks filled from the right: the fused kernel reads them unflipped with a
    flipped mask and must agree with the reference (which flips the gathered copy)."""
    cache = _cache(3, 200, 8, 32, dtype)
    lengths = [13, 40, 7, 29, 64, 1]
    bucket, logical = _bucket(cache, lengths, reversed_share=0.5, seed=3)
    assert bucket.reversed is not None and bucket.reversed.sum() >= 3
    assert not torch.equal(bucket.slot_bias(), bucket.bias)  # some partial block is reversed
    q = torch.randn(len(lengths), 6, 32).to(dtype)
    got = compiled.decode(q, cache, bucket, 32**-0.5)
    torch.testing.assert_close(got.float(), reference_decode(q, cache, bucket, 32**-0.5).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), _dense(q, logical, 32**-0.5), atol=tol, rtol=tol)


def test_one_graph_for_every_shape_and_pool():
    """After warm-up, new batch sizes, table widths and pool sizes must not recompile
    (a recompile costs seconds in the middle of serving)."""
    dim, bs = 64, 16
    compiled.warm_up(_cache(3, 64, bs, dim, torch.bfloat16), 9, dim**-0.5)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for blocks, lengths in [(64, [3]), (64, [40, 17]), (300, [100, 1, 250, 31, 77]), (97, [16] * 33)]:
            cache = _cache(3, blocks, bs, dim, torch.bfloat16)  # made outside inference mode, as the engine's
            bucket, logical = _bucket(cache, lengths)
            with torch.inference_mode():  # the mode the engine steps (and warm_up compiles) in
                q = torch.randn(len(lengths), 9, dim).to(torch.bfloat16)
                got = compiled.decode(q, cache, bucket, dim**-0.5)
            torch.testing.assert_close(got.double(), _dense(q, logical, dim**-0.5), atol=2e-2, rtol=2e-2)


def _with_new_token(q_heads, kv_heads, dim, dtype, lengths, seed):
    """A cache holding each sequence's context (`lengths`, 0 allowed), half the blocks
    reversed, plus this step's k, v per sequence (not in the cache) and the dense result
    over context + new token."""
    cache = _cache(kv_heads, 200, 8, dim, dtype)
    bucket, logical = _bucket(cache, lengths, reversed_share=0.5, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lengths), q_heads, dim, generator=gen).to(dtype)
    k_new, v_new = (torch.randn(len(lengths), kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    full = [torch.cat((kv, torch.stack((k_new[i], v_new[i])).unsqueeze(2)), 2) for i, kv in enumerate(logical)]
    return cache, bucket, q, k_new, v_new, _dense(q, full, dim**-0.5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("lengths", [[12, 0, 33, 64, 1], [70], [5, 9]])
def test_decode_with_new_token_matches_dense(dtype, tol, lengths):
    """The compiled-layer variant: context from the cache (reversed blocks included, a row
    with no context at all), the step's own token from its fresh k, v; eager and compiled."""
    cache, bucket, q, k_new, v_new, want = _with_new_token(6, 3, 32, dtype, lengths, seed=len(lengths))
    scale = 32**-0.5
    chunks = bucket.chunks(compiled.chunk_blocks(8))
    eager = compiled.decode_with_new_math(
        q, k_new, v_new, cache, chunks.table, chunks.seq, chunks.bias, chunks.seq_chunks, scale
    )
    torch.testing.assert_close(eager.double(), want, atol=tol, rtol=tol)
    seqs = max(2, len(lengths))  # the graph takes no size-1 batch (decode_graph.py doubles it)
    pad = (0, 0, 0, 0, 0, seqs - len(lengths))
    graph = compiled.compile_copy(compiled.decode_with_new_math, "test_decode_new", (dtype, seqs > 2))
    args = [F.pad(t, pad) for t in (q, k_new, v_new)]
    for t in args:
        torch._dynamo.mark_dynamic(t, 0)
    got = graph(*args, cache, *compiled.graph_chunks(chunks, seqs), scale)[: len(lengths)]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
