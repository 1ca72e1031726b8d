"""The simulator's hot spot made faster with identical decisions (docs/aptserve.md, "The
simulator's hot spot"): `knapsack.options` written out for its two points, `solve` computing
each candidate's options once, and `AptServePolicy.hidden_kept_next_decode` memoised per
schedule call. The reference below is the general code they replaced (the hull over any
number of points, options recomputed for the fallback, no memo); a fixed simulated trace
must make the same decisions step by step with either."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.scheduling.aptserve as aptserve_module
import engine.scheduling.knapsack as knapsack
from engine.scheduling.apt_values import make_candidate
from engine.scheduling.knapsack import SKIP, Candidate, Choice, option_value


def reference_options(c: Candidate, capacity: int):
    points = [(c.kv_blocks, option_value(c, False), Choice(True, False))]
    if c.hidden_blocks is not None:
        points.append((c.hidden_blocks, option_value(c, True), Choice(True, True)))
    points = sorted((p for p in points if p[0] <= capacity and p[1] > 0), key=lambda p: (p[0], -p[1]))
    out: list = []
    for point in points:
        if out and point[1] <= out[-1][1]:
            continue
        if out and knapsack._below_chord(out[-1], point, out[-2] if len(out) > 1 else (0, 0.0)):
            out.pop()
        out.append(point)
    return tuple(out)


def reference_solve(candidates, capacity: int):
    steps = []
    for i, c in enumerate(candidates):
        prev_blocks, prev_value = 0, 0.0
        for rank, (blocks, value, choice) in enumerate(reference_options(c, capacity)):
            dm, dv = blocks - prev_blocks, value - prev_value
            steps.append((-dv / dm, rank, i, choice, dm, dv))
            prev_blocks, prev_value = blocks, value
    steps.sort(key=lambda s: (s[0], s[1], s[2]))
    chosen, taken, used, total = [SKIP] * len(candidates), [0] * len(candidates), 0, 0.0
    for _, rank, i, choice, dm, dv in steps:
        if taken[i] != rank or used + dm > capacity:
            continue
        used, total, taken[i] = used + dm, total + dv, rank + 1
        chosen[i] = choice
    best = None
    for i, c in enumerate(candidates):
        for _, value, choice in reference_options(c, capacity):
            if best is None or value > best[1]:
                best = (i, value, choice)
    if best is not None and best[1] > total:
        single = [SKIP] * len(candidates)
        single[best[0]] = best[2]
        return single
    return chosen


def reference_kept(self, r, kv_blocks, hidden_blocks, outstanding, capacity):
    bonus = self.reprefill_seconds(r.num_tokens) if self.price_switches else 0.0
    holds = True if self.price_switches else None
    after = make_candidate(aptserve_module.FRESH_VALUE, kv_blocks, hidden_blocks, outstanding, self.rho, holds, bonus)
    return any(choice.hidden for _, _, choice in reference_options(after, capacity))


@st.composite
def candidate(draw):
    m = draw(st.integers(1, 40))
    h = draw(st.one_of(st.none(), st.integers(1, 40)))
    holds = draw(st.sampled_from([None, False] + ([True] if h is not None else [])))
    value = draw(st.one_of(st.just(0.0), st.floats(-1, 10)))
    penalty = draw(st.one_of(st.just(0.0), st.floats(0, 10)))
    bonus = draw(st.floats(0, 5)) if holds is not None else 0.0
    return Candidate(value, m, h, penalty, holds, bonus), draw(st.integers(0, 50))


@settings(max_examples=200, deadline=None)
@given(candidate())
def test_options_equal_the_general_hull(case):
    c, capacity = case
    assert knapsack.options(c, capacity) == reference_options(c, capacity)


def _decisions(policy: str, rho: float | None, monkeypatch=None) -> list:
    """Every schedule call's outcome on a fixed simulated trace (the pool binds)."""
    from loadgen.sim.policy_trace import trace

    log: list = []

    def hook(worker):
        inner = worker.scheduler.policy.schedule

        def logged(state):
            batch = inner(state)
            log.append(
                (
                    round(state.now, 9),
                    [(it.request.request_id, it.num_new_tokens, it.request.cache_form.value) for it in batch.items],
                    [r.request_id for r in batch.preempted],
                )
            )
            return batch

        worker.scheduler.policy.schedule = logged

    trace(policy, 16.0, 0, 100 / 16.0, "opt-13b-a100-40gb", rho, on_worker=hook, max_num_seqs=256)
    return log


@pytest.mark.parametrize(
    "policy,rho",
    [("aptserve", None), ("aptserve-priced", 1e-5)],  # the default; conversions priced, HIDDEN chosen
)
def test_a_fixed_trace_makes_the_same_decisions(policy, rho, monkeypatch):
    fast = _decisions(policy, rho)
    with monkeypatch.context() as m:
        m.setattr(aptserve_module, "options", reference_options)
        m.setattr(aptserve_module, "solve", reference_solve)
        m.setattr(aptserve_module.AptServePolicy, "hidden_kept_next_decode", reference_kept)
        reference = _decisions(policy, rho)
    assert len(fast) > 100 and any(step[2] for step in reference)  # the pool bound: preemptions
    if rho is not None:
        assert any(form == "hidden" for step in reference for _, _, form in step[1])
    assert fast == reference
