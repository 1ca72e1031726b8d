"""`paged_attention`'s decode rows selected by a slice (`DecodeBucket.row_range`, what the runner
gives the split-K kernels' one bucket) compute exactly what the index gather/scatter computes:
decode-only steps (where the kernel's output is returned as it is) and steps mixing decode rows
with a prefill chunk, for the reference and the C++ kernel, with q a strided view of a fused QKV
output as the model passes it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.attention import paged_attention, write_kv_cache
from kernels.cpu import decode as cpu_decode
from kernels.metadata import AttentionMetadata, DecodeBucket, PrefillSpan

HEADS, KV_HEADS, DIM, BS, BLOCKS = 9, 3, 64, 16, 64
SCALE = DIM**-0.5


def _kernels() -> list[str]:
    return ["reference", "cpp"] if cpu_decode.available() else ["reference"]


def _step(dtype, decode_lens: list[int], prefill_len: int, consecutive: bool):
    """A cache holding each decode row's context (its own token included) and, when
    `prefill_len`, a fresh prefill chunk after the decode rows; returns (q, k, v, cache, meta)
    with q, k, v strided views of one [T, (H + 2 KVH) * D] projection output."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, KV_HEADS, BLOCKS, BS, DIM, dtype=dtype)
    free = (torch.randperm(BLOCKS - 1, generator=gen) + 1).tolist()
    decodes = len(decode_lens)
    rows = decodes + prefill_len
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(dtype)
    q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    q, k, v = q.view(rows, HEADS, DIM), k.view(rows, KV_HEADS, DIM), v.view(rows, KV_HEADS, DIM)
    width = max(-(-n // BS) for n in decode_lens)
    table = torch.zeros(decodes, width, dtype=torch.long)
    slots = []
    for i, n in enumerate(decode_lens):
        blocks = [free.pop() for _ in range(-(-n // BS))]
        table[i, : len(blocks)] = torch.tensor(blocks)
        ctx = torch.randn(n - 1, KV_HEADS, DIM, generator=gen).to(dtype)
        ctx_slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(n - 1)], dtype=torch.long)
        write_kv_cache(cache, ctx, ctx.flip(0), ctx_slots)
        slots.append(blocks[(n - 1) // BS] * BS + (n - 1) % BS)
    spans = []
    if prefill_len:
        blocks = [free.pop() for _ in range(-(-prefill_len // BS))]
        slots += [blocks[p // BS] * BS + p % BS for p in range(prefill_len)]
        spans.append(PrefillSpan(q_start=decodes, q_len=prefill_len, ctx_len=0, block_ids=None))
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    write_kv_cache(cache, k.contiguous(), v.contiguous(), slot_mapping)
    valid = torch.arange(width * BS).unsqueeze(0) < torch.tensor(decode_lens).unsqueeze(1)
    bucket = DecodeBucket(
        rows=torch.arange(decodes),
        row_range=slice(0, decodes) if consecutive else None,
        block_table=table,
        bias=torch.zeros(valid.shape).masked_fill_(~valid, float("-inf")).unsqueeze(1),
        lens=torch.tensor(decode_lens, dtype=torch.long),
    )
    meta = AttentionMetadata(slot_mapping=slot_mapping, decode_buckets=[bucket], prefills=spans, scale=SCALE)
    return q, k, v, cache, meta


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefill_len", [0, 23])
def test_row_slice_equals_row_index(kernel, dtype, prefill_len):
    lens = [5, 40, 17, 300, 1, 64]
    q, k, v, cache, meta = _step(dtype, lens, prefill_len, consecutive=True)
    by_slice = paged_attention(q, k, v, cache, dataclasses.replace(meta, decode_kernel=kernel))
    _, _, _, _, indexed = _step(dtype, lens, prefill_len, consecutive=False)
    by_index = paged_attention(q, k, v, cache, dataclasses.replace(indexed, decode_kernel=kernel))
    assert by_slice.shape == by_index.shape == q.shape
    torch.testing.assert_close(by_slice, by_index, rtol=0, atol=0)
    reference = paged_attention(q, k, v, cache, dataclasses.replace(indexed, decode_kernel="reference"))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(by_slice.float(), reference.float(), rtol=tol, atol=tol)


def test_a_bucket_that_is_not_every_row_keeps_the_general_path():
    """A decode-only bucket covering only some rows (eLLM's rebuilt rows or HIDDEN rows come
    after it) must not be returned as the whole output."""
    q, k, v, cache, meta = _step(torch.float32, [9, 30], 0, consecutive=True)
    bucket = meta.decode_buckets[0]
    assert bucket.covers(2) and not bucket.covers(3)
    wider = torch.cat([q, q[:1]])
    out = paged_attention(wider, torch.cat([k, k[:1]]), torch.cat([v, v[:1]]), cache, meta)
    assert out.shape == wider.shape
    torch.testing.assert_close(out[:2], paged_attention(q, k, v, cache, meta), rtol=0, atol=0)
