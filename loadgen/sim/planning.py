"""The cost model a simulated policy plans with: fitted to a noisy profile, never the truth.

In the simulator a profile's `CostModel` is the *truth*: it sets every simulated step's
duration (times the step noise, `sim/jitter.py`). A policy that plans with that same
function (BROS's slack packing, Apt-Serve's knapsack) knows each step's duration exactly,
something no real scheduler does; BROS then packs every step to the last millisecond of its
budget and its TTFT p99 lands exactly on the SLO. On a real machine a policy plans with what
`tandem profile` measured: the profiler's power-of-two grid of dummy batches, each timed
once on a machine with noise, fitted by least squares.

`planning_model` does exactly that against the truth: it times the profiler's grid
(`engine/profiling.py`'s shapes, sized by the worker) with the truth times one noise draw per
point, and fits each phase with the profiler's own `fit`. The noise stream is seeded apart
from the run's step noise, so the profile and the run never see the same draws. The truth is
itself a linear `CostModel`, so with no noise the fit recovers it and planning is exact
(`--step-noise none`); the fitted model and its gap to the truth are in every result JSON.
"""

from __future__ import annotations

import zlib

from engine.cost_model import CostModel, Sample, fit, mape
from loadgen.sim.jitter import StepJitter

_PROFILE_STREAM = zlib.crc32(b"planning-profile")  # keeps profile draws apart from step draws


def planning_model(
    truth: CostModel,
    noise: StepJitter | None,
    *,
    seed: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    capacity_tokens: int,
    block_size: int = 16,
) -> CostModel:
    draw = noise.sampler(seed ^ _PROFILE_STREAM) if noise is not None else (lambda: 1.0)
    prefill = [_time(truth, draw, rows, prefill=True) for rows in _prefill_rows(max_num_batched_tokens, max_model_len)]
    decode = [
        _time(truth, draw, rows, prefill=False)
        for rows in _decode_rows(max_num_seqs, max_model_len, capacity_tokens, block_size)
    ]
    pfit, dfit = fit(prefill), fit(decode)
    # The hybrid cache's rebuild price (aptserve's ρ): the profiler measures it too, so the
    # planning model gets the truth's with one noise draw, like every other profiled point.
    hidden = None if truth.hidden_s_per_token is None else truth.hidden_s_per_token * draw()
    meta = {
        **truth.meta,
        "source": "fitted to a simulated profile of the truth with step noise (loadgen/sim/planning.py)",
        "truth_source": truth.meta.get("source"),
        "profile_noise": None if noise is None else noise.describe(),
        "profile_seed": seed,
        "num_samples": len(prefill) + len(decode),
        "prefill_mape": mape(pfit, prefill),
        "decode_mape": mape(dfit, decode),
        "prefill_vs_truth": _relative_gap(pfit, truth.prefill, prefill),
        "decode_vs_truth": _relative_gap(dfit, truth.decode, decode),
    }
    return CostModel(
        pfit,
        dfit,
        truth.swap_bytes_per_s,
        meta,
        hidden_s_per_token=hidden,
        hidden_free_rows=truth.hidden_free_rows,  # the knee is the GEMM's shape, not a timing
        hidden_free_s_per_token=truth.hidden_free_s_per_token * draw(),
    )


def _time(truth: CostModel, draw, rows: list[tuple[int, int]], *, prefill: bool) -> Sample:
    ln = sum(n for n, _ in rows)
    work = sum(n * a for n, a in rows)
    seconds = truth.estimate(rows, []) if prefill else truth.estimate([], rows)
    return Sample(ln, work, seconds * draw())


def _relative_gap(fitted, true, samples: list[Sample]) -> float:
    """Mean (fitted - truth) / truth over the grid: the planning model's bias."""
    gaps = [
        (fitted.predict_work(s.ln, s.work) - true.predict_work(s.ln, s.work)) / true.predict_work(s.ln, s.work)
        for s in samples
    ]
    return sum(gaps) / len(gaps)


def _pow2(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


def _prefill_rows(max_batched: int, max_model_len: int) -> list[list[tuple[int, int]]]:
    """The profiler's prefill grid: n tokens in k fresh prompts of n/k tokens each."""
    top = min(max_batched, max_model_len - 1)
    return [[(n // k, n // k)] * k for n in _pow2(16, top) for k in (1, 4) if n // k >= 8]


def _decode_rows(max_seqs: int, max_model_len: int, capacity: int, block: int) -> list[list[tuple[int, int]]]:
    """The profiler's decode grid: b requests decoding one token over c context tokens."""
    contexts = _pow2(64, min(max_model_len - 1, 2048))
    batches = _pow2(1, min(max_seqs, 256))
    return [[(1, c)] * b for b in batches for c in contexts if b * (c + block) <= capacity]
