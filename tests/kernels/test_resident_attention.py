"""Partial residency's attention (kernels/reference/resident.py): a rebuilt prefix held in the
step's own rows plus the paged resident part, whose block list has empty entries (id 0) for
the prefix, merged by log-sum-exp, equals dense causal attention over all keys."""

from __future__ import annotations

import pytest
import torch

from kernels import TransientSpan
from kernels.reference.resident import attend_transient, paged_partial
from tests.kernels.test_partial_attention import _dense

BS, HEAD_DIM = 4, 8


def _paged(k, v, blocks: list[int], num_blocks: int, kv_heads: int) -> torch.Tensor:
    """A cache `[2, kv_heads, num_blocks, BS, D]` holding token p of k/v in block blocks[p // BS]
    (entries with block 0 are left out: the null block stays garbage)."""
    cache = torch.randn(2, kv_heads, num_blocks, BS, HEAD_DIM) * 100  # garbage where nothing is written
    for p in range(k.shape[0]):
        if blocks[p // BS]:
            cache[0, :, blocks[p // BS], p % BS] = k[p]
            cache[1, :, blocks[p // BS], p % BS] = v[p]
    return cache


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("prefix_blocks,q_len", [(1, 1), (3, 1), (2, 5), (4, 3)])
def test_rebuilt_prefix_and_paged_part_merge_to_dense(heads, kv_heads, prefix_blocks, q_len):
    g = torch.Generator().manual_seed(heads + 10 * prefix_blocks + q_len)
    total, scale = 26, HEAD_DIM**-0.5
    ctx = total - q_len
    k = torch.randn(total, kv_heads, HEAD_DIM, generator=g)
    v = torch.randn(total, kv_heads, HEAD_DIM, generator=g)
    q = torch.randn(q_len, heads, HEAD_DIM, generator=g)
    entries = -(-total // BS)
    blocks = [0] * prefix_blocks + list(range(3, 3 + entries - prefix_blocks))
    cache = _paged(k, v, blocks, 3 + entries, kv_heads)
    prefix = prefix_blocks * BS
    # the step's rows: its new tokens' queries first, then the rebuilt prefix's K/V
    q_rows = torch.cat([q, torch.zeros(prefix, heads, HEAD_DIM)])
    k_rows = torch.cat([k[ctx:], k[:prefix]])
    v_rows = torch.cat([v[ctx:], v[:prefix]])
    span = TransientSpan(0, q_len, ctx, q_len, prefix, torch.tensor(blocks))
    out = torch.zeros_like(q_rows)
    attend_transient(out, q_rows, k_rows, v_rows, cache, [span], scale)
    torch.testing.assert_close(out[:q_len].double(), _dense(q, k, v, ctx, scale), atol=2e-5, rtol=1e-5)
    assert not out[q_len:].any()  # the prefix rows are another span's business


def test_paged_partial_reads_only_resident_entries():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(16, 2, HEAD_DIM, generator=g)
    v = torch.randn(16, 2, HEAD_DIM, generator=g)
    q = torch.randn(1, 2, HEAD_DIM, generator=g)
    cache = _paged(k, v, [0, 0, 5, 6], 8, 2)
    out, lse = paged_partial(
        q, cache, torch.tensor([0, 0, 5, 6]), resident_from=8, kv_len=16, q_pos0=15, scale=HEAD_DIM**-0.5
    )
    expected = torch.softmax(torch.einsum("hd,khd->hk", q[0], k[8:]) * HEAD_DIM**-0.5, dim=-1)
    torch.testing.assert_close(out[0], torch.einsum("hk,khd->hd", expected, v[8:]))
    assert torch.isfinite(lse).all()
