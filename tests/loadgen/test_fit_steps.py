"""Fitting the cost model to logged engine steps (`loadgen.sim.fit_steps`)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cost_model import CostModel, PhaseFit
from loadgen.sim.fit_steps import fit_steps

TRUE = CostModel(PhaseFit(1e-3, 4e-7, 0.02), PhaseFit(2.5e-3, 1e-7, 0.02), 1e10, {})


def _logged_steps(noise: float, n: int = 600, seed: int = 0):
    """Steps priced by TRUE times mean-one log-normal noise (a busy machine's jitter)."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(n):
        decodes = [(1, int(rng.integers(20, 400))) for _ in range(int(rng.integers(1, 12)))]
        prefills = [(int(rng.integers(16, 300)), 0)] if rng.random() < 0.2 else []
        factor = rng.lognormal(-(noise**2) / 2, noise)  # E[factor] = 1
        steps.append((prefills, decodes, TRUE.estimate(prefills, decodes) * factor))
    return steps


def test_exact_steps_recover_the_model():
    cost = fit_steps(_logged_steps(noise=0.0))
    assert cost.meta["step_mape"] < 1e-6
    assert cost.decode.alpha0 == pytest.approx(TRUE.decode.alpha0, rel=1e-3)
    assert cost.prefill.beta == pytest.approx(TRUE.prefill.beta, rel=1e-3)


def test_noisy_steps_are_not_fitted_low():
    """Mean predicted step time stays at the mean logged step time under 35% jitter
    (weighting by the observed times put it ~10% low, and every simulated latency with it)."""
    steps = _logged_steps(noise=0.35)
    cost = fit_steps(steps)
    logged = np.mean([t for *_, t in steps])
    predicted = np.mean([cost.estimate(p, d) for p, d, _ in steps])
    assert predicted == pytest.approx(logged, rel=0.03)


def test_too_few_steps_is_an_error():
    with pytest.raises(ValueError, match="at least 5"):
        fit_steps(_logged_steps(noise=0.0, n=3))
