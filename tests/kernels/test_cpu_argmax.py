"""The C++ greedy argmax (kernels/cpu/argmax.cpp) against its oracle `torch.argmax(x, dim=1)`:
every build target this CPU may run (under the AVX2 emulation variables only the AVX2 one),
float32 and bfloat16, row lengths around the vector widths (ties and the maximum in the body
and in the scalar tail), ties, NaN, +-inf and signed-zero rows, strided rows; bad input; the
start-up choice with its fallback; and the sampler's greedy rows through it."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from engine.sampler import Sampler
from engine.sampling import SamplingParams
from kernels.cpu import build
from kernels.greedy import CppArgmax, choose_argmax, torch_argmax
from tests.conftest import requires_cxx
from tests.kernels.test_cpu_decode import TARGETS

pytestmark = requires_cxx

DTYPES = [torch.float32, torch.bfloat16]
NAN, INF = math.nan, math.inf


@pytest.fixture(scope="module", params=TARGETS)
def argmax(request) -> CppArgmax:
    return CppArgmax(request.param)


def _same(argmax, x):
    got, want = argmax(x), x.argmax(dim=1)
    assert got.dtype == torch.long and torch.equal(got, want), (got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 7), (5, 8), (4, 16), (6, 17), (9, 33), (64, 4099), (2, 49152)])
def test_random_rows(argmax, dtype, rows, vocab):
    gen = torch.Generator().manual_seed(rows * 7919 + vocab)
    _same(argmax, (torch.randn(rows, vocab, generator=gen) * 4).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [5, 16, 23, 40, 100])
def test_ties_go_to_the_lowest_index(argmax, dtype, vocab):
    """The maximum placed twice (or more) at every pair of positions, in the vector body and
    in the tail; also rows that are all one value and rows whose tie is -0.0 against +0.0."""
    rows = []
    for i in range(vocab):
        for j in range(i + 1, vocab, 3):
            row = torch.full((vocab,), -1.0)
            row[i] = row[j] = 2.5
            rows.append(row)
    x = torch.stack(rows + [torch.full((vocab,), 0.75), torch.zeros(vocab)])
    zeros = torch.full((2, vocab), -1.0)
    zeros[0, vocab // 2], zeros[0, -1] = -0.0, 0.0
    zeros[1, 0], zeros[1, -1] = 0.0, -0.0
    _same(argmax, torch.cat([x, zeros]).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [3, 16, 37])
def test_nan_and_inf_rows(argmax, dtype, vocab):
    """torch treats NaN as the maximum (the first NaN wins, even over +inf); all -inf gives 0."""
    specials = []
    for pos in sorted({0, 1, vocab // 2, vocab - 1}):
        for fill in (NAN, INF, -INF):
            row = torch.randn(vocab)
            row[pos] = fill
            specials.append(row)
        row = torch.randn(vocab)
        row[pos], row[-1] = NAN, NAN  # two NaNs: the first
        specials.append(row)
        row = torch.randn(vocab)
        row[pos], row[0] = NAN, INF  # NaN after +inf
        specials.append(row)
    specials += [torch.full((vocab,), -INF), torch.full((vocab,), INF), torch.full((vocab,), NAN)]
    _same(argmax, torch.stack(specials).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_and_transposed_rows(argmax, dtype):
    wide = torch.randn(9, 300).to(dtype)
    _same(argmax, wide[:, 5:260])  # rows of a wider tensor, stride(0) > V
    _same(argmax, wide[::2])  # every other row
    _same(argmax, torch.randn(50, 6).to(dtype).t())  # last dimension not contiguous: copied first


def test_no_rows_and_other_dtypes(argmax):
    assert argmax(torch.randn(0, 10)).shape == (0,)
    x = torch.randn(4, 9, dtype=torch.float64)
    assert torch.equal(argmax(x), x.argmax(dim=1))  # not the op's dtype: torch answers


@pytest.mark.parametrize("target", TARGETS)
def test_bad_input_is_a_clear_error(target):
    ops = CppArgmax(target)._ns
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.argmax_rows(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"\[N, V\]"):
        ops.argmax_rows(torch.zeros(3))
    with pytest.raises(RuntimeError, match=r"\[N, V\]"):
        ops.argmax_rows(torch.zeros(2, 0))


def test_choice_at_start(caplog):
    with caplog.at_level(logging.INFO, logger="kernels.greedy"):
        assert choose_argmax("torch", "cpu") is torch_argmax
        chosen = choose_argmax("auto", "cpu")
    assert isinstance(chosen, CppArgmax) if TARGETS else chosen is torch_argmax
    assert "greedy argmax: torch.argmax" in caplog.text
    with pytest.raises(ValueError, match="greedy_kernel"):
        choose_argmax("fast", "cpu")


def test_failing_build_falls_back_with_a_warning(monkeypatch, caplog):
    """auto: a build that fails (no compiler) warns and uses torch.argmax; cpp: the error."""

    def broken(target=None):
        raise build.KernelBuildError("no C++ compiler found")

    monkeypatch.setattr("kernels.cpu.decode.ops", broken)
    monkeypatch.setattr(build, "target_for", lambda caps=None: "avx2")
    with caplog.at_level(logging.WARNING, logger="kernels.greedy"):
        assert choose_argmax("auto", "cpu") is torch_argmax
    assert "C++ greedy argmax unavailable" in caplog.text
    with pytest.raises(build.KernelBuildError):
        choose_argmax("cpp", "cpu")


def test_sampler_greedy_rows_match_torch(argmax):
    """The sampler's greedy rows (with bans, mixed with sampled rows) through the op give the
    tokens the torch.argmax sampler gives, ties included."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 515, generator=gen)
    logits[1, 100] = logits[1, 7] = 50.0  # a tie: id 7
    logits[2, 3] = 60.0  # banned below: the next best wins
    params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams(temperature=1.0, seed=5)] * 2
    gens = [None] * 4 + [torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)]
    bans = [[], [], [3], [], [], []]
    mine = Sampler(0, argmax=argmax).sample(logits, params, gens, bans)
    gens = [None] * 4 + [torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)]
    theirs = Sampler(0).sample(logits, params, gens, bans)
    assert mine.token_ids == theirs.token_ids
    assert mine.token_ids[1] == 7 and mine.token_ids[2] != 3
