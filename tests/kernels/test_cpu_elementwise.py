"""The fused elementwise C++ ops (kernels/cpu/elementwise.cpp) against their plain-PyTorch oracle
(kernels/reference/elementwise.py), through `kernels.layer_ops`: every build target this CPU may
run (under the AVX2 emulation variables only the AVX2 one), float32 and bfloat16, sizes that
are not multiples of the vector width, strided rows as the fused projections give them; the
in-place contracts; bad input; and the start-up choice with its fallback."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels.cpu import build
from kernels.layer_ops import TORCH_LAYER_OPS, CppLayerOps, TorchLayerOps, choose_layer_ops
from tests.conftest import requires_cxx
from tests.kernels.test_cpu_decode import TARGETS

pytestmark = requires_cxx

REF = TORCH_LAYER_OPS
DTYPES = [torch.float32, torch.bfloat16]
# float32: a few ulps (sum order, exp polynomial); bfloat16: one rounding of the output, since
# the C++ ops round once where the op-by-op reference rounds after every op
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(scope="module", params=TARGETS)
def cpp(request) -> CppLayerOps:
    return CppLayerOps(request.param)


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 67), (33, 576), (3, 5)])
def test_add_rms_norm(cpp, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    residual = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    want_out, want_res = REF.add_rms_norm(residual, delta, weight, 1e-6)
    mine = residual.clone()
    got_out, got_res = cpp.add_rms_norm(mine, delta, weight, 1e-6)
    assert got_res.data_ptr() == mine.data_ptr()  # the residual is updated in place...
    assert torch.equal(got_res, want_res)  # ...to exactly residual + delta (one rounding in either)
    _close(got_out, want_out, dtype)
    # no delta: the norm alone, the residual untouched
    alone_out, alone_res = cpp.add_rms_norm(residual.clone(), None, weight, 1e-6)
    assert torch.equal(alone_res, residual)
    _close(alone_out, REF.add_rms_norm(residual, None, weight, 1e-6)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_strided_rows(cpp, dtype):
    """Rows of a wider tensor (a view), as a projection's output slice would be."""
    wide = torch.randn(9, 100).to(dtype)
    delta_wide = torch.randn(9, 100).to(dtype)
    weight = torch.rand(64).to(dtype)
    want_out, want_res = REF.add_rms_norm(wide[:, :64], delta_wide[:, 10:74], weight, 1e-5)
    got_out, got_res = cpp.add_rms_norm(wide[:, :64], delta_wide[:, 10:74], weight, 1e-5)
    assert torch.equal(wide[:, :64], want_res)  # written through the view
    _close(got_out, want_out, dtype)


def _rope_tables(max_pos: int, dim: int, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 32), (8, 8, 128), (3, 1, 6)])
def test_qk_norm_rope(cpp, dtype, qk_norm, heads, kv_heads, dim):
    """In place on the q and k heads of a fused QKV output (rows strided past the v part); v is
    untouched. float32 without q/k norms is bitwise the reference (same products, same sum)."""
    t = 11
    gen = torch.Generator().manual_seed(heads * dim + qk_norm)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 2, 7, 15, 16, 100, 255, 3, 3, 42])
    cos, sin = _rope_tables(256, dim, dtype)
    norms = (None, None)
    if qk_norm:
        norms = (torch.rand(dim, generator=gen).to(dtype), torch.rand(dim, generator=gen).to(dtype))
    qk_size = (heads + kv_heads) * dim
    ref_tables = REF.rope_tables(cos, sin, positions)
    want = REF.qk_norm_rope(qkv[:, :qk_size].view(t, -1, dim), ref_tables, heads, *norms, 1e-6)
    mine = qkv.clone()
    view = mine[:, :qk_size].view(t, -1, dim)
    got = cpp.qk_norm_rope(view, cpp.rope_tables(cos, sin, positions), heads, *norms, 1e-6)
    assert got.data_ptr() == mine.data_ptr()
    assert torch.equal(mine[:, qk_size:], qkv[:, qk_size:])  # v untouched
    if dtype == torch.float32 and not qk_norm:
        assert torch.equal(got, want)
    else:
        _close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (5, 37), (70, 64), (2, 3)])
def test_silu_mul(cpp, dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 6).to(dtype)
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0]).to(dtype)[: min(3, inter)]  # exp under/overflow
    _close(cpp.silu_mul(gate_up), REF.silu_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_layers_and_one_layer(cpp, dtype):
    """Bytes equal to the reference's index_copy_, for every layer at once and for one layer's
    view, from k/v that are strided views of a QKV output."""
    layers, kvh, nb, bs, d, t = 3, 2, 6, 4, 16, 9
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    qkv = torch.randn(layers, t, 5 * kvh * d, generator=gen).to(dtype)
    k = qkv[..., 3 * kvh * d : 4 * kvh * d].unflatten(-1, (kvh, d))
    v = qkv[..., 4 * kvh * d :].unflatten(-1, (kvh, d))
    base = torch.randn(layers, 2, kvh, nb, bs, d, generator=gen).to(dtype)
    want, got = base.clone(), base.clone()
    REF.write_kv_layers(want, k, v, slots)
    cpp.write_kv_layers(got, k, v, slots)
    assert torch.equal(got, want)
    one_want, one_got = base.clone(), base.clone()
    REF.write_kv(one_want[1], k[1], v[1], slots)
    cpp.write_kv(one_got[1], k[1], v[1], slots)
    assert torch.equal(one_got, one_want)


def test_bad_input_is_a_clear_error(cpp):
    cache = torch.zeros(1, 2, 2, 4, 4, 16)
    k = torch.zeros(1, 2, 2, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpp.write_kv_layers(cache, k, k, torch.tensor([0, 16]))
    with pytest.raises(RuntimeError, match="the cache's dtype"):
        cpp.write_kv_layers(cache, k.double(), k.double(), torch.tensor([0, 1]))
    cos = torch.zeros(8, 16)
    with pytest.raises(RuntimeError, match="outside the table"):
        cpp.qk_norm_rope(torch.zeros(2, 3, 16), cpp.rope_tables(cos, cos, torch.tensor([1, 8])), 2, None, None, 1e-6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpp.silu_mul(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="weight must be"):
        cpp.add_rms_norm(torch.zeros(2, 8), None, torch.ones(7), 1e-6)


def test_targets_agree():
    """The AVX2 build and the native one compute the same thing (up to float summation order)."""
    if len(TARGETS) < 2:
        pytest.skip("only one target runs on this CPU")
    x, w = torch.randn(5, 300), torch.rand(300)
    gate_up = torch.randn(5, 600) * 4
    outs = [(o.add_rms_norm(x.clone(), x, w, 1e-6)[0], o.silu_mul(gate_up)) for o in map(CppLayerOps, TARGETS)]
    for norm, silu in outs[1:]:
        torch.testing.assert_close(norm, outs[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(silu, outs[0][1], atol=1e-5, rtol=1e-5)


def test_choice_at_start(caplog):
    caplog.set_level(logging.INFO, logger="kernels.layer_ops")
    assert isinstance(choose_layer_ops("auto", "cpu", torch.float32), CppLayerOps)
    assert "C++ kernels" in caplog.text
    assert isinstance(choose_layer_ops("auto", "cpu", torch.float16), TorchLayerOps)  # no float16 kernels
    assert choose_layer_ops("off", "cpu", torch.float32) is TORCH_LAYER_OPS
    with pytest.raises(ValueError, match="float16"):
        choose_layer_ops("cpp", "cpu", torch.float16)
    with pytest.raises(ValueError, match="fused_ops"):
        choose_layer_ops("yes", "cpu", torch.float32)


def test_failing_build_falls_back_with_a_warning(monkeypatch, caplog):
    """auto: a build that fails (no compiler) warns and runs PyTorch op by op; cpp: the error."""

    def broken(target=None):
        raise build.KernelBuildError("no C++ compiler found")

    monkeypatch.setattr("kernels.cpu.elementwise.ops", broken)
    with caplog.at_level(logging.WARNING, logger="kernels.layer_ops"):
        assert choose_layer_ops("auto", "cpu", torch.float32) is TORCH_LAYER_OPS
    assert "fused layer ops unavailable" in caplog.text
    with pytest.raises(build.KernelBuildError):
        choose_layer_ops("cpp", "cpu", torch.float32)
