"""eLLM's transient prefix on the Triton kernels (kernels/triton/resident.py): the rebuilt
prefix by the partial-attention kernel, the paged rest by the extend kernel with its
log-sum-exp, merged; against the reference (kernels/reference/resident.py) and float64
dense attention, under the interpreter on CPU tensors (or on CUDA).

Several spans in one step (a decode row, a chunk, a one-block prefix, a prefix of several
blocks, partial last blocks), GQA 1/3/8, head dims 64 and 128, float32 (2e-5) and bfloat16
(2e-2: the output is rounded to bf16). Every cache slot that holds no resident token is NaN,
including the blocks behind the prefix's entries: a stray read poisons the output.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import AttentionMetadata, TransientSpan
from kernels.reference.resident import attend_transient as reference_transient
from tests.kernels.test_partial_attention import _dense

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
BS = 8
# (context tokens before the step, new tokens, rebuilt prefix blocks)
SPANS = [(30, 1, 2), (21, 6, 1), (16, 1, 2), (40, 9, 3)]


def _case(group, head_dim, dtype, seed):
    """Rows: every span's new tokens, then every span's rebuilt prefix rows (the runner's order)."""
    g = torch.Generator().manual_seed(seed)
    kv_heads, heads = 2, 2 * group
    tokens = sum(n for _, n, _ in SPANS) + sum(p * BS for _, _, p in SPANS)
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    num_blocks = 2 + sum(-(-(c + n) // BS) for c, n, _ in SPANS)
    cache = torch.full((2, kv_heads, num_blocks, BS, head_dim), float("nan"), dtype=dtype)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    spans, logical = [], []
    row, prefix_row = 0, sum(n for _, n, _ in SPANS)
    for ctx, n, prefix_blocks in SPANS:
        total, prefix = ctx + n, prefix_blocks * BS
        kv = torch.randn(2, total, kv_heads, head_dim, generator=g).to(dtype)
        logical.append(kv)
        k[row : row + n], v[row : row + n] = kv[0, ctx:], kv[1, ctx:]
        k[prefix_row : prefix_row + prefix], v[prefix_row : prefix_row + prefix] = kv[0, :prefix], kv[1, :prefix]
        # prefix entries: block 0 (the null block, NaN), and the first one a fresh block that
        # holds NaN too (a shrinking ratio gives one back before it is refilled)
        ids = [free.pop() if b == 0 else 0 for b in range(prefix_blocks)]
        for b in range(prefix_blocks, -(-total // BS)):
            ids.append(free.pop())
            part = slice(b * BS, min(total, (b + 1) * BS))
            cache[0, :, ids[b], : part.stop - part.start] = kv[0, part].transpose(0, 1)
            cache[1, :, ids[b], : part.stop - part.start] = kv[1, part].transpose(0, 1)
        spans.append(TransientSpan(row, n, ctx, prefix_row, prefix, torch.tensor(ids)))
        row, prefix_row = row + n, prefix_row + prefix
    return q, k, v, cache, spans, logical


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (8, 64), (3, 128)])
def test_transient_spans_match_reference_and_dense(triton_kernels, kernel_device, dtype, group, head_dim):
    q, k, v, cache, spans, logical = _case(group, head_dim, dtype, seed=group * head_dim)
    scale = head_dim**-0.5
    expected = torch.full_like(q, 5.0)
    reference_transient(expected, q, k, v, cache, spans, scale)

    on = lambda t: t.to(kernel_device)  # noqa: E731
    meta = AttentionMetadata(
        slot_mapping=on(torch.zeros(q.shape[0], dtype=torch.long)),
        decode_buckets=[],
        prefills=[],
        scale=scale,
        decode_kernel="triton",
        transient=[dataclasses.replace(s, block_ids=on(s.block_ids)) for s in spans],
    )
    got = on(torch.full_like(q, 5.0))
    triton_kernels.attend_transient(got, on(q), on(k), on(v), on(cache), meta)
    got = got.cpu()
    new_rows = sum(n for _, n, _ in SPANS)
    assert got.dtype == dtype and not got[:new_rows].isnan().any()
    assert (got[new_rows:] == 5).all()  # the prefix rows are their own ctx-0 span's business
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), expected.double(), atol=tol, rtol=tol, equal_nan=True)
    for s, kv in zip(spans, logical):
        rows = slice(s.q_start, s.q_start + s.q_len)
        dense = _dense(q[rows].float(), kv[0].float(), kv[1].float(), s.ctx_len, scale)
        torch.testing.assert_close(got[rows].double(), dense, atol=tol, rtol=tol)
