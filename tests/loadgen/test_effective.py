"""Effective-throughput bisection against attainment curves with a known crossing."""

from __future__ import annotations

import pytest

from loadgen.effective import effective_throughput


def step_curve(knee: float):
    return lambda rate: 0.95 if rate <= knee else 0.5


@pytest.mark.parametrize("knee", [0.3, 1.0, 3.7, 11.0])
def test_finds_the_knee_within_tolerance(knee):
    res = effective_throughput(step_curve(knee), 0.9, start=1.0, rel_tol=0.02)
    assert res.rate <= knee
    assert res.rate >= knee * 0.97
    assert res.bracketed
    assert all(a >= 0.9 for r, a in res.probes if r <= knee)


def test_linear_curve_crossing():
    res = effective_throughput(lambda r: 1.0 - 0.1 * r, 0.6, start=1.0, rel_tol=0.01)
    assert res.rate == pytest.approx(4.0, rel=0.02)


def test_never_met_gives_zero_and_always_met_is_unbracketed():
    assert effective_throughput(lambda r: 0.0, 0.9, start=1.0).rate == 0.0
    res = effective_throughput(lambda r: 1.0, 0.9, start=1.0, max_rate=16.0)
    assert res.rate == 16.0 and not res.bracketed


def test_bad_target_is_a_value_error():
    with pytest.raises(ValueError):
        effective_throughput(lambda r: 1.0, 1.5)
