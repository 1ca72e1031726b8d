"""Cost model: fitting recovers known coefficients, O(1) sums equal per-request estimates,
swap overlap semantics, and the JSON file round-trips (the simulator's contract)."""

from __future__ import annotations

import json
import random

import pytest

from engine.cost_model import CostModel, PhaseFit, Sample, fit, mape


def _samples(truth: PhaseFit, noise: float, rng: random.Random) -> list[Sample]:
    out = []
    for batch in (1, 2, 4, 8, 16):
        for ctx in (16, 64, 256, 1024):
            ln, work = batch, batch * ctx
            out.append(Sample(ln, work, truth.predict_work(ln, work) * (1 + rng.uniform(-noise, noise))))
    return out


def test_fit_recovers_coefficients():
    truth = PhaseFit(alpha0=2e-4, alpha1=3e-8, beta=5e-3)
    got = fit(_samples(truth, 0.0, random.Random(0)))
    assert got.alpha0 == pytest.approx(truth.alpha0, rel=1e-6)
    assert got.alpha1 == pytest.approx(truth.alpha1, rel=1e-6)
    assert got.beta == pytest.approx(truth.beta, rel=1e-6)


def test_fit_with_noise_has_small_error_and_no_negative_terms():
    truth = PhaseFit(alpha0=1e-4, alpha1=0.0, beta=2e-2)
    samples = _samples(truth, 0.05, random.Random(1))
    got = fit(samples)
    assert min(got.alpha0, got.alpha1, got.beta) >= 0
    assert mape(got, samples) < 0.05


def test_fit_needs_samples():
    with pytest.raises(ValueError, match="at least 3"):
        fit([(1, 1, 0.1)])


def _model(overlap: bool) -> CostModel:
    return CostModel(
        PhaseFit(1e-3, 1e-6, 0.01), PhaseFit(2e-3, 2e-6, 0.02), swap_bytes_per_s=1e9, meta={"swap_overlaps": overlap}
    )


def test_estimate_uses_per_request_products_and_one_beta():
    m = _model(False)
    prefill, decode = [(100, 100), (50, 150)], [(1, 300), (1, 40)]
    p = 1e-3 * 150 + 1e-6 * (100 * 100 + 50 * 150) + 0.01
    d = 2e-3 * 2 + 2e-6 * (300 + 40) + 0.02
    assert m.estimate(prefill, decode) == pytest.approx(p + d - 0.01)
    assert m.estimate([], decode) == pytest.approx(d)
    assert m.estimate([], []) == 0.0


def test_swap_overlap_max_or_sum():
    decode = [(1, 100)] * 4
    exec_s = _model(False).estimate([], decode)
    assert _model(False).estimate([], decode, swap_bytes=10**8) == pytest.approx(exec_s + 0.1)
    assert _model(True).estimate([], decode, swap_bytes=10**8) == pytest.approx(max(exec_s, 0.1))
    assert _model(True).estimate([], decode, swap_bytes=10**8, overlap=False) == pytest.approx(exec_s + 0.1)


def test_save_load_round_trip(tmp_path):
    m = _model(True)
    path = tmp_path / "sub" / "cm.json"
    m.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "tandem-cost-model/1" and set(data["prefill"]) == {"alpha0", "alpha1", "beta"}
    back = CostModel.load(path)
    assert back == m and back.meta == m.meta


def test_load_rejects_bad_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        CostModel.load(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="not a cost model"):
        CostModel.load(tmp_path / "x.json")
    (tmp_path / "y.json").write_text('{"format": "tandem-cost-model/1", "prefill": {}}')
    with pytest.raises(ValueError, match="malformed"):
        CostModel.load(tmp_path / "y.json")
