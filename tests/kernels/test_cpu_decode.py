"""The C++ decode attention kernel (kernels/cpu/) against the reference `_decode` and against
float64 dense attention over the logical keys: every build target this CPU may run (under the
AVX2 emulation variables, only the AVX2 one), float32 and bfloat16 caches, GQA groups of 1, 3
and 8, head dims 64 and 128 (and small ones), partial and reversed (BROS) blocks, 1-token
contexts, contexts over several splits; the own-token variant the compiled layers use; batch
invariance; the op inside a compiled graph; bad input and a failing build."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import build
from kernels.cpu import decode as cpu_decode
from kernels.reference.attention import _decode as reference_decode
from tests.conftest import cpu_kernel_targets, requires_cxx
from tests.kernels.test_compiled_decode import _bucket, _cache, _dense

pytestmark = requires_cxx

TARGETS = cpu_kernel_targets()
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _run(target, q, cache, bucket, scale, k_new=None, v_new=None):
    ops = cpu_decode.ops(target)
    table = cpu_decode.signed_table(bucket.block_table, bucket.reversed)
    return ops.decode(q, cache, table, bucket.context_lens(), k_new, v_new, scale)


def test_native_target_is_chosen_by_the_probe():
    assert build.target_for() == TARGETS[-1] if TARGETS else build.target_for() is None


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,bs",
    [(9, 3, 64, 16), (8, 8, 64, 16), (16, 2, 128, 16), (6, 2, 128, 8), (8, 1, 64, 4), (4, 2, 32, 8), (4, 4, 16, 4)],
)
def test_matches_reference_and_dense(target, dtype, heads, kv_heads, dim, bs):
    """Lengths: 1 token, partial blocks, exact blocks, and contexts over several 256-token splits."""
    if dim % (16 if target.startswith("avx512") else 8):
        pytest.skip("head_dim not a multiple of the vector width")
    lengths = [1, 5, 37, 3, 16, 64, 9, 300, 700]
    cache = _cache(kv_heads, 1100 // bs * 2, bs, dim, dtype)
    bucket, logical = _bucket(cache, lengths, reversed_share=0.3, seed=heads + dim + bs)
    q = torch.randn(len(lengths), heads, dim).to(dtype)
    scale = dim**-0.5
    got = _run(target, q, cache, bucket, scale)
    assert got.shape == q.shape and got.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), reference_decode(q, cache, bucket, scale).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), _dense(q, logical, scale), atol=tol, rtol=tol)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reversed_blocks(target, dtype):
    """BROS blocks filled from the right (partial ones hold their tokens at the far end)."""
    cache = _cache(3, 200, 8, 64, dtype)
    bucket, logical = _bucket(cache, [13, 40, 7, 29, 64, 1], reversed_share=0.5, seed=3)
    assert bucket.reversed is not None and bucket.reversed.sum() >= 3
    q = torch.randn(6, 9, 64).to(dtype)
    got = _run(target, q, cache, bucket, 0.125)
    torch.testing.assert_close(got.double(), _dense(q, logical, 0.125), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_own_token_from_fresh_kv(target, dtype):
    """The compiled layers' variant: cached context (a row with none at all, reversed blocks)
    plus the step's own k, v, not in the cache, from strided views as the model makes them."""
    lengths = [12, 0, 33, 300, 1]
    cache = _cache(2, 200, 16, 64, dtype)
    bucket, logical = _bucket(cache, lengths, reversed_share=0.5, seed=7)
    gen = torch.Generator().manual_seed(8)
    qkv = torch.randn(len(lengths), 8 + 2 + 2, 64, generator=gen).to(dtype)  # q, k, v heads side by side
    q, k_new, v_new = qkv.split([8, 2, 2], dim=1)
    full = [torch.cat((kv, torch.stack((k_new[i], v_new[i])).unsqueeze(2)), 2) for i, kv in enumerate(logical)]
    got = _run(target, q, cache, bucket, 0.125, k_new, v_new)
    torch.testing.assert_close(got.double(), _dense(q, full, 0.125), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("target", TARGETS)
def test_batch_invariant(target):
    """A sequence's result is bitwise the same alone and in any batch (fixed split size)."""
    lengths = [700, 40, 300, 5]
    cache = _cache(3, 200, 16, 64, torch.bfloat16)
    bucket, _ = _bucket(cache, lengths, seed=11)
    q = torch.randn(len(lengths), 9, 64).to(torch.bfloat16)
    together = _run(target, q, cache, bucket, 0.125)
    for i in range(len(lengths)):
        alone = type(bucket)(
            rows=torch.arange(1), block_table=bucket.block_table[i : i + 1], bias=bucket.bias[i : i + 1]
        )
        assert torch.equal(_run(target, q[i : i + 1], cache, alone, 0.125), together[i : i + 1])


def test_targets_agree():
    """The AVX2 build and the native one compute the same thing (up to float summation order)."""
    if len(TARGETS) < 2:
        pytest.skip("only one target runs on this CPU")
    cache = _cache(3, 100, 16, 64, torch.float32)
    bucket, _ = _bucket(cache, [50, 300, 7], seed=5)
    q = torch.randn(3, 9, 64)
    outs = [_run(t, q, cache, bucket, 0.125) for t in TARGETS]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)


def test_inside_a_compiled_graph_without_recompiles():
    """The op traced by Dynamo/Inductor (as in the compiled decoder layers): every batch size
    and table width through one graph."""
    dim = 64
    cpu_decode.ops()  # loaded before tracing, as the engine does at start
    graph = torch.compile(cpu_decode.decode_with_new, fullgraph=True, dynamic=False)
    cache = _cache(3, 300, 16, dim, torch.bfloat16)
    for i, lengths in enumerate([[3, 40], [100, 1, 250, 31, 77], [16] * 33, [0, 5]]):
        bucket, logical = _bucket(cache, lengths, seed=20 + i)
        q = torch.randn(len(lengths), 9, dim).to(torch.bfloat16)
        k_new, v_new = (torch.randn(len(lengths), 3, dim).to(torch.bfloat16) for _ in range(2))
        for t in (q, k_new, v_new):
            torch._dynamo.mark_dynamic(t, 0)
        context = cpu_decode.graph_context(bucket, len(lengths))
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = graph(q, k_new, v_new, cache, context, dim**-0.5)
        full = [torch.cat((kv, torch.stack((k_new[j], v_new[j])).unsqueeze(2)), 2) for j, kv in enumerate(logical)]
        torch.testing.assert_close(got.double(), _dense(q, full, dim**-0.5), atol=2e-2, rtol=2e-2)


def test_bad_input_is_a_clear_error():
    ops = cpu_decode.ops()
    cache = _cache(3, 10, 16, 64, torch.bfloat16)
    table, lens = torch.zeros(1, 2, dtype=torch.long), torch.tensor([5])
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.decode(torch.zeros(1, 9, 64), cache, table, lens, None, None, 0.1)
    with pytest.raises(RuntimeError, match="context beyond table"):
        ops.decode(torch.zeros(1, 9, 64, dtype=torch.bfloat16), cache, table, torch.tensor([33]), None, None, 0.1)
    with pytest.raises(RuntimeError, match="head grouping"):
        ops.decode(torch.zeros(1, 8, 64, dtype=torch.bfloat16), cache, table, lens, None, None, 0.1)


def test_failing_build_is_a_kernel_build_error(monkeypatch, tmp_path):
    """A compiler that fails (or none at all) raises KernelBuildError, which `attention=auto`
    turns into a warning and the reference kernel (tests/engine/test_tiny_models.py)."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # found on PATH, exits 1
    with pytest.raises(build.KernelBuildError, match="build failed"):
        build.build(TARGETS[-1])
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(build.KernelBuildError, match="no C\\+\\+ compiler"):
        build.build(TARGETS[-1])
