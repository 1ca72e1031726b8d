"""The Triton partial attention and merge (kernels/triton/partial.py) under the interpreter on
CPU tensors (or compiled on CUDA), against the PyTorch contract (kernels/reference/partial.py)
and float64 dense attention.

Edge cases: one-token queries, parts that end inside a tile, a part wholly after the queries
(lse -inf, output 0), queries that are the last keys of their part (a chunk over itself),
GQA ratios 1/3/8, head dims 64 and 128, float32 and bfloat16, several segments of one launch
writing compact output rows, and a merge of 1-3 parts with an empty one.

Tolerances: float32 2e-5 (float32 accumulation in another order); bfloat16 inputs 1e-4 on the
float32 outputs (the products of bf16 values are exact in float32; only the order differs),
and lse within 1e-5 for both.
"""

from __future__ import annotations

import pytest
import torch

from kernels.reference import partial as reference
from tests.kernels.test_partial_attention import _dense

TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-4}


@pytest.fixture(scope="module")
def tp(triton_kernels, kernel_device):
    """The Triton partial kernels with inputs moved to the kernel device and results back."""
    from kernels.triton import partial

    class On:
        device = kernel_device

        @staticmethod
        def attend(q, k, v, **kw):
            out, lse = partial.attend_partial(q.to(kernel_device), k.to(kernel_device), v.to(kernel_device), **kw)
            return out.cpu(), lse.cpu()

        @staticmethod
        def merge(parts):
            out, lse = partial.merge_partials([(o.to(kernel_device), s.to(kernel_device)) for o, s in parts])
            return out.cpu(), lse.cpu()

    return On


def _inputs(q_len, kv_len, heads, kv_heads, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_len, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(kv_len, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(kv_len, kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v


def _close(got, expected, dtype):
    torch.testing.assert_close(got.double(), expected.double(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_partial_matches_reference(tp, dtype, head_dim, group):
    """A chunk of 5 queries over 37 keys ending with themselves (the causal edge inside a
    tile), and one query over a prefix that wholly precedes it (eLLM's rebuilt prefix)."""
    kv_heads, scale = 2, head_dim**-0.5
    q, k, v = _inputs(5, 37, kv_heads * group, kv_heads, head_dim, dtype, group * head_dim)
    for q_rows, q_pos0, k_pos0 in ((slice(0, 5), 32, 0), (slice(2, 3), 40, 3)):
        got = tp.attend(q[q_rows], k, v, q_pos0=q_pos0, k_pos0=k_pos0, scale=scale)
        expected = reference.attend_partial(q[q_rows], k, v, q_pos0=q_pos0, k_pos0=k_pos0, scale=scale)
        assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
        _close(got[0], expected[0], dtype)
        torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-5)


def test_rows_that_see_no_key_get_zero_and_minus_infinity(tp):
    q, k, v = _inputs(3, 20, 4, 2, 64, torch.float32, 1)
    out, lse = tp.attend(q, k, v, q_pos0=0, k_pos0=4, scale=0.125)  # keys 4.., queries 0..2
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    out, lse = tp.attend(q, k, v, q_pos0=3, k_pos0=4, scale=0.125)  # query 3 sees none, 4 and 5 see some
    expected = reference.attend_partial(q, k, v, q_pos0=3, k_pos0=4, scale=0.125)
    assert torch.isneginf(lse[0]).all() and not out[0].any()
    torch.testing.assert_close(out, expected[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[1:], expected[1][1:])
    empty = tp.attend(q, k[:0], v[:0], q_pos0=5, k_pos0=0, scale=0.125)  # no keys at all
    assert not empty[0].any() and torch.isneginf(empty[1]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_split_parts_merge_to_dense(tp, dtype, group):
    """Keys cut into 3 parts (one empty for the queries), attended and merged by the Triton
    kernels: dense causal attention over all keys, and the reference merge's lse."""
    q, k, v = _inputs(4, 45, 2 * group, 2, 64, dtype, 7 + group)
    q_pos0, scale = 41, 0.125
    bounds = [0, 17, 45, 45]
    parts = [tp.attend(q, k[a:b], v[a:b], q_pos0=q_pos0, k_pos0=a, scale=scale) for a, b in zip(bounds, bounds[1:])]
    out, lse = tp.merge(parts)
    ref_out, ref_lse = reference.merge_partials(parts)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)
    _close(out, _dense(q.float(), k.float(), v.float(), q_pos0, scale), dtype)
    single, _ = tp.merge(parts[:1])
    torch.testing.assert_close(single, parts[0][0], atol=1e-6, rtol=1e-6)


def test_merge_of_parts_no_row_sees(tp):
    zeros = (torch.zeros(2, 3, 64), torch.full((2, 3), float("-inf")))
    out, lse = tp.merge([zeros, zeros])
    assert not out.any() and torch.isneginf(lse).all()


def test_one_launch_for_many_segments_writes_compact_rows(tp, triton_kernels, kernel_device):
    """Segments of one launch with their own positions, K/V rows and output rows (the engine's
    form): each equals the reference on its slice; rows of no segment are left untouched."""
    from kernels.triton.partial import Segment, attend_segments, segment_plan
    from kernels.triton.tiles import tile_config

    q, k, v = _inputs(12, 50, 6, 2, 64, torch.float32, 3)
    segments = [
        Segment(q_start=0, q_len=1, q_pos0=20, k_start=0, k_len=20, k_pos0=0, o_start=7),
        Segment(q_start=1, q_len=7, q_pos0=9, k_start=20, k_len=16, k_pos0=0, o_start=0),
        Segment(q_start=8, q_len=4, q_pos0=3, k_start=36, k_len=14, k_pos0=0, o_start=8),  # 3 of 4 see keys 0..
    ]
    tiles = tile_config(torch.device(kernel_device))
    plan = segment_plan(segments, 3, tiles, torch.device(kernel_device))
    out = torch.full((13, 6, 64), 7.0, device=kernel_device)
    lse = torch.full((13, 6), 7.0, device=kernel_device)
    on = [t.to(kernel_device) for t in (q, k, v)]
    attend_segments(*on, plan, 0.125, out, lse, tiles, True)
    out, lse = out.cpu(), lse.cpu()
    for s in segments:
        rows = slice(s.o_start, s.o_start + s.q_len)
        keys = slice(s.k_start, s.k_start + s.k_len)
        expected = reference.attend_partial(
            q[s.q_start : s.q_start + s.q_len], k[keys], v[keys], q_pos0=s.q_pos0, k_pos0=s.k_pos0, scale=0.125
        )
        torch.testing.assert_close(out[rows], expected[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse[rows], expected[1], atol=1e-5, rtol=1e-5)
    assert (out[12] == 7).all() and (lse[12] == 7).all()


def test_uneven_gqa_is_a_clear_error(tp):
    with pytest.raises(ValueError, match="cannot share"):
        tp.attend(torch.zeros(1, 5, 64), torch.zeros(2, 2, 64), torch.zeros(2, 2, 64), q_pos0=1, k_pos0=0, scale=1.0)
