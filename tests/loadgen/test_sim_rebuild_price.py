"""The simulator's price of a HIDDEN rebuild against the roofline it claims to follow
(docs/aptserve.md, "ρ"): the rebuilt rows share the step's K/V projection GEMM, so below that
GEMM's knee they cost only bytes, past it its FLOPs; the gather and scatter are added."""

from __future__ import annotations

import dataclasses

import pytest

from engine.cost_model import CostModel, PhaseFit
from loadgen.sim.roofline import GPUS, MODELS, Efficiency, build_profile, rebuild_prices

OPT, A100, EFF = MODELS["opt-13b"], GPUS["a100-40gb"], Efficiency()


def _kernels(rows_before: int, rebuilt: int) -> float:
    """Seconds the rebuild adds, kernel by kernel: the K/V GEMM over the step's rows plus the
    rebuilt ones (its own roofline max, per layer), less the same GEMM without them, plus the
    gather and scatter (memory-bound)."""
    bw, peak, b = A100.hbm_bytes_per_s * EFF.mbu, A100.peak_flops * EFF.mfu, OPT.dtype_bytes
    d, w = OPT.hidden, OPT.kv_width

    def gemm(rows: int) -> float:
        return max(2 * rows * d * w / peak, (d * w + rows * (d + w)) * b / bw) * OPT.layers

    moves = rebuilt * OPT.layers * b * (2 * d + 2 * w) / bw
    return gemm(rows_before + rebuilt) - gemm(rows_before) + moves


@pytest.mark.parametrize("rows_before", [1, 32, 124, 130, 256])
@pytest.mark.parametrize("rebuilt", [16, 64, 100, 500, 4000])
def test_the_rebuild_price_follows_the_kernels_roofline(rows_before, rebuilt):
    cost = build_profile("opt-13b", "a100-40gb")
    assert cost.hidden_seconds(rebuilt, step_rows=rows_before) == pytest.approx(
        _kernels(rows_before, rebuilt), rel=1e-6
    )


def test_small_rebuilds_ride_under_the_gemm_weights_and_large_ones_pay_flops():
    """The former price was linear from the first token (26.9 us each): a decode step of 32 rows
    rebuilding 64 tokens paid 1.7 ms; under the GEMM's knee it pays the bytes, 0.19 ms."""
    r = rebuild_prices(OPT, A100, EFF)
    # about dtype x peak / (2 x bandwidth) rows (125), a little more for the rows' own bytes
    assert 125 < r.free_rows < 135
    cost = build_profile("opt-13b", "a100-40gb")
    assert cost.hidden_seconds(64, step_rows=32) == pytest.approx(64 * r.free_s_per_token)
    assert cost.hidden_seconds(64, step_rows=32) < 0.2 * 64 * r.s_per_token
    # the step's own new tokens fill the knee first: a prefill-sized step leaves none free
    assert cost.hidden_seconds(64, step_rows=512) == pytest.approx(64 * r.s_per_token)


def test_a_measured_profile_has_no_knee_and_the_knee_survives_a_round_trip(tmp_path):
    measured = CostModel(PhaseFit(1e-4, 0, 0), PhaseFit(1e-4, 0, 0), 1e9, {}, 2e-4)
    assert measured.hidden_seconds(100, step_rows=1) == pytest.approx(100 * 2e-4)
    kneed = dataclasses.replace(measured, hidden_free_rows=50, hidden_free_s_per_token=1e-6)
    assert kneed.hidden_seconds(100, step_rows=10) == pytest.approx(40 * 1e-6 + 60 * 2e-4)
    kneed.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == kneed
    measured.save(tmp_path / "m.json")
    assert "hidden_free_rows" not in (tmp_path / "m.json").read_text()
