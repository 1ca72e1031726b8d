"""Fit the cost model to step times logged by a real engine run (online profiling).

`tandem profile` times synthetic batches in isolation; a serving engine's steps also pay the
scheduler, the sampler and whatever else shares the machine. Fitting to the steps of a real
run captures those costs. The model is the worker's own (`CostModel`): one regression over
all steps, mixed ones included,

    t = a0_p * Ln_p + a1_p * W_p + a0_d * Ln_d + a1_d * W_d + beta

(`Ln` = new tokens, `W` = sum of new tokens x context, per phase), non-negative (a negative
coefficient is dropped and the rest refitted). Both phases get the same `beta`, so
`CostModel.exec_seconds` (which charges one fixed overhead for a mixed step) reproduces the
fitted function exactly.

Relative errors are what matter (a 5 ms decode step and a 500 ms prefill step should fit
equally well), so rows are weighted by 1/t. Weighting by the *observed* t is biased low on
noisy logs: a step that happened to run fast gets more weight than one that ran slow, and the
fit settled about 7-10% under the mean step time, which made every simulated latency
optimistic (docs/simulator.md). The weights are therefore re-derived from the fit's own
predictions, which do not depend on each step's noise (iteratively reweighted least squares).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.cost_model import CostModel, PhaseFit, nonneg_lstsq, phase_sums

_REWEIGHTS = 4  # the weights settle after two or three rounds

StepLog = Sequence[tuple[list[tuple[int, int]], list[tuple[int, int]], float]]


def fit_steps(steps: StepLog, swap_bytes_per_s: float = 1e10, meta: dict | None = None) -> CostModel:
    if len(steps) < 5:
        raise ValueError(f"need at least 5 logged steps to fit, got {len(steps)}")
    x = np.array([[*phase_sums(p), *phase_sums(d), 1.0] for p, d, _ in steps], dtype=np.float64)
    y = np.array([t for _, _, t in steps], dtype=np.float64)
    coef = nonneg_lstsq(x, y, 1.0 / np.maximum(y, 1e-9))
    for _ in range(_REWEIGHTS):
        coef = nonneg_lstsq(x, y, 1.0 / np.maximum(x @ np.asarray(coef), 1e-9))
    cost = CostModel(
        PhaseFit(coef[0], coef[1], coef[4]),
        PhaseFit(coef[2], coef[3], coef[4]),
        swap_bytes_per_s,
        {"source": "fitted to logged engine steps", "num_steps": len(steps), **(meta or {})},
    )
    pred = np.array([cost.estimate(p, d) for p, d, _ in steps])
    cost.meta["step_mape"] = float(np.mean(np.abs(pred - y) / y))
    return cost
