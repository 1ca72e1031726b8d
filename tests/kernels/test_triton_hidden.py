"""HIDDEN rows on the Triton kernels (kernels/triton/hidden.py) against the reference
(kernels/reference/hidden.py), under the interpreter on CPU tensors (or on CUDA).

The rebuild is a stand-in returning fixed context K/V (the model's projection is checked by
the engine tests, tests/engine/test_hybrid_cache.py); the store and gather are the
reference's own code on both paths, so what is compared is the attention and the merge:
sequences with and without context, one-token rows, a chunk over its own tokens, GQA 1/3/8,
head dims 64 and 128, float32 (2e-5) and bfloat16 (2e-2: the output is rounded to bf16).
Rows that are not HIDDEN are left as they were, and the dispatch follows the step's kernel.
"""

from __future__ import annotations

import pytest
import torch

from kernels import AttentionMetadata, HiddenBatch, HiddenSeq, hidden_attention
from kernels.reference import hidden as reference

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
SEQS = [(1, 0), (1, 20), (6, 0), (5, 13), (17, 9)]  # (new tokens, context tokens)


def _case(group, head_dim, dtype, seed, first_row=3):
    """A step whose HIDDEN rows start at `first_row`, with the inputs both paths take."""
    g = torch.Generator().manual_seed(seed)
    kv_heads, heads = 2, 2 * group
    tokens = first_row + sum(n for n, _ in SEQS)
    ctx_total = sum(c for _, c in SEQS)
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    k_ctx = torch.randn(ctx_total, kv_heads, head_dim, generator=g).to(dtype)
    v_ctx = torch.randn(ctx_total, kv_heads, head_dim, generator=g).to(dtype)
    x = torch.randn(tokens, head_dim, generator=g).to(dtype)  # hidden size = head_dim: one chunk
    seqs, row, ctx = [], first_row, 0
    for n, c in SEQS:
        seqs.append(HiddenSeq(row, n, ctx, c))
        row, ctx = row + n, ctx + c
    bs = 4
    blocks = 2 + -(-ctx_total // bs) + -(-tokens // bs)
    cache = torch.zeros(2, kv_heads, blocks, bs, head_dim, dtype=dtype)
    hidden_rows = torch.arange(first_row, tokens)
    batch = HiddenBatch(
        rows=hidden_rows,
        write_rows=(hidden_rows + 4 * bs).unsqueeze(1),  # anywhere: the stand-in rebuild ignores what it gathers
        units=torch.arange(1, 1 + -(-ctx_total // bs)),
        ctx_rows=torch.arange(ctx_total),
        ctx_positions=torch.cat([torch.arange(c) for _, c in SEQS]),
        seqs=seqs,
        hidden_size=head_dim,
    )
    return q, k, v, x, cache, batch, (k_ctx, v_ctx)


def _run(path, case, device, scale):
    q, k, v, x, cache, batch, (k_ctx, v_ctx) = case
    on = [t.to(device) for t in (q, k, v, x, cache, k_ctx, v_ctx)]
    batch = HiddenBatch(**{f: getattr(batch, f) for f in ("seqs", "hidden_size")} | {
        f: getattr(batch, f).to(device) for f in ("rows", "write_rows", "units", "ctx_rows", "ctx_positions")
    })  # fmt: skip
    calls = []

    def rebuild(x_ctx, *args):
        calls.append(x_ctx.shape)
        return on[5], on[6]

    out = torch.full_like(on[0], 3.0)
    path(out, *on[:5], batch, rebuild, scale)
    return out.cpu(), on[4].cpu(), calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (8, 64), (3, 128)])
def test_hidden_rows_match_the_reference(triton_kernels, kernel_device, dtype, group, head_dim):
    from kernels.triton import hidden as triton_hidden

    case = _case(group, head_dim, dtype, seed=group + head_dim)
    scale = head_dim**-0.5
    got, got_cache, calls = _run(triton_hidden.hidden_attention, case, kernel_device, scale)
    expected, expected_cache, _ = _run(reference.hidden_attention, case, "cpu", scale)
    assert calls == [(sum(c for _, c in SEQS), head_dim)]  # one rebuild for the whole step
    assert got.dtype == dtype and (got[:3] == 3).all()  # rows that are not HIDDEN untouched
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), expected.double(), atol=tol, rtol=tol)
    assert torch.equal(got_cache, expected_cache)  # the layer inputs are stored the same way


def test_dispatch_follows_the_steps_kernel(triton_kernels, kernel_device, monkeypatch):
    """`hidden_attention` takes the Triton path when the step's kernel is "triton" (the models
    pass the metadata's), the reference otherwise."""
    from kernels.reference import hidden as ref_module
    from kernels.triton import hidden as triton_module

    taken = []
    monkeypatch.setattr(triton_module, "hidden_attention", lambda *a: taken.append("triton"))
    monkeypatch.setattr(ref_module, "hidden_attention", lambda *a: taken.append("reference"))
    for kernel in ("triton", "cpp", "reference"):
        batch = _case(1, 64, torch.float32, 0)[5]
        meta = AttentionMetadata(torch.zeros(1, dtype=torch.long), [], [], 1.0, decode_kernel=kernel, hidden=batch)
        hidden_attention(None, None, None, None, None, None, meta.hidden, None, 1.0, meta.decode_kernel)
    assert taken == ["triton", "reference", "reference"]
