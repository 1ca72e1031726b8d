"""The transient-K/V contract (kernels/reference/partial.py): any split of a request's keys
into parts, attended separately and merged by log-sum-exp, equals dense causal attention."""

from __future__ import annotations

import pytest
import torch

from kernels.reference.partial import attend_partial, merge_partials


def _dense(q, k, v, q_pos0, scale):
    """float64 causal attention of q (positions q_pos0..) over keys at positions 0.."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(heads // kv_heads, dim=1)
    vv = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    q_pos = torch.arange(q_pos0, q_pos0 + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vv)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("cuts", [(), (5,), (1, 17), (0, 12, 20)])
@pytest.mark.parametrize("q_len", [1, 4])
def test_split_keys_merge_to_dense_attention(heads, kv_heads, cuts, q_len):
    g = torch.Generator().manual_seed(heads * 100 + q_len + len(cuts))
    total, head_dim, scale = 24, 16, 16**-0.5
    q = torch.randn(q_len, heads, head_dim, generator=g)
    k = torch.randn(total, kv_heads, head_dim, generator=g)
    v = torch.randn(total, kv_heads, head_dim, generator=g)
    q_pos0 = total - q_len  # the queries are the last tokens: a chunk attending its own keys
    bounds = [0, *cuts, total]
    parts = [
        attend_partial(q, k[a:b], v[a:b], q_pos0=q_pos0, k_pos0=a, scale=scale) for a, b in zip(bounds, bounds[1:])
    ]
    out, lse = merge_partials(parts)
    assert out.dtype == torch.float32 and lse.shape == (q_len, heads)
    torch.testing.assert_close(out.double(), _dense(q, k, v, q_pos0, scale), atol=2e-5, rtol=1e-5)


def test_a_part_after_every_query_contributes_nothing():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 2, 8, generator=g) for n in (2, 6, 6))
    out, lse = attend_partial(q, k, v, q_pos0=0, k_pos0=4, scale=0.3)  # keys 4..9, queries 0..1
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse < 0).all()
    before = attend_partial(q, k, v, q_pos0=3, k_pos0=-3, scale=0.3)
    merged, merged_lse = merge_partials([before, (out, lse)])
    torch.testing.assert_close(merged, before[0])
    torch.testing.assert_close(merged_lse, before[1])


def test_bfloat16_inputs_accumulate_in_float32():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, 3, 64, generator=g) for n in (3, 40, 40))
    prefix = attend_partial(q.bfloat16(), k[:30].bfloat16(), v[:30].bfloat16(), q_pos0=37, k_pos0=0, scale=0.125)
    suffix = attend_partial(q.bfloat16(), k[30:].bfloat16(), v[30:].bfloat16(), q_pos0=37, k_pos0=30, scale=0.125)
    out, _ = merge_partials([prefix, suffix])
    assert out.dtype == torch.float32
    expected = _dense(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), 37, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


def test_uneven_gqa_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot share"):
        attend_partial(torch.zeros(1, 5, 8), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), q_pos0=1, k_pos0=0, scale=1.0)
