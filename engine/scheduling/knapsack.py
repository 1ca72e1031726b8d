"""Apt-Serve's per-iteration packing problem and its greedy 2-approximation (paper §5 and
the online appendix's Algorithm 1; notes §2.6-2.8), as a pure function for the coming
`aptserve` policy.

Each candidate request picks one option: skip (memory 0, value 0), HIDDEN (memory `h` =
its hidden-form blocks, value `p - c` with the penalty `c = N·ρ·m̄`) or KV (memory `m̄`, value
`p`); the total memory is at most the capacity M and the total value is maximised (a
multiple-choice knapsack; 0-1 knapsack when HIDDEN is never offered, hence NP-hard).

The greedy: each request's options become increments (0 -> HIDDEN -> KV, or 0 -> KV),
sorted by value per block (θ); increments are taken in that order (the paper stops at the
first that does not fit; we go on, below); then the best single request alone is compared
and the better of the two is kept.

Decisions where the paper is silent or loose (notes §2.8, pitfall 9):
- *Options that cannot fit alone are dropped first* (KV when `m̄ > M`, HIDDEN when `h > M`),
  then *LP-dominated HIDDEN options* (`(p-c)/h < p/m̄`, the paper's refinement `p < 2Nρm̄`
  for h = m̄/2, written for any ratio) and non-positive ones. What is left is concave per
  request (θ_hidden >= θ_upgrade), so the fractional greedy is the LP optimum and
  `ALG >= OPT/2` holds (tested against brute force).
- *Past the critical increment the greedy goes on filling*: an increment that does not fit
  is skipped (and so is the rest of that request's chain), later smaller ones are still
  taken. The paper's Algorithm 1 stops there; in a serving loop that strands free blocks
  and, in a decode iteration, preempts every request sorted after one large one (measured
  in the simulator). The stopping prefix is a subset of what we take, so the value only
  grows and `ALG >= OPT/2` still holds.
- *Ties* put every first increment before any upgrade, so a request's upgrade never precedes
  its HIDDEN step.
- *The fallback is the best single request* in its best feasible form (value >= the
  critical increment's marginal value `V'` the paper compares, so the bound still holds, and
  it is never worse); it is always feasible because infeasible options were dropped.
- Memory is in blocks (integers): `h = ceil(m̄·r)` from the model's ratio r.
- *Keeping a form is worth the re-prefill it avoids* (not in the paper; docs/aptserve.md,
  "Conversions priced"): a running request's option in the form it holds gets `keep_bonus`
  on top of its value; its other form and skipping it (preemption) do not, since both drop
  its cache and re-prefill it. So a request changes form only when the value gained beats
  that re-prefill. Its options then need not be ordered as the paper's (a HIDDEN request's
  KV option can be worth *less* than staying HIDDEN): every option below the upper concave
  hull of `(0, 0)`, HIDDEN, KV is dropped, which keeps each request's increments concave, so
  the LP argument and `ALG >= OPT/2` hold as before (tested against brute force).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """One request's options this iteration."""

    value: float  # p: what scheduling it is worth (pending time, after SLO demotion)
    kv_blocks: int  # m̄: blocks it needs in KV form (> 0)
    hidden_blocks: int | None = None  # h: blocks in HIDDEN form; None: HIDDEN not offered
    hidden_penalty: float = 0.0  # c = N·ρ·m̄: what HIDDEN costs everyone else
    holds_hidden: bool | None = None  # the form it holds now (True: HIDDEN); None: holds nothing
    keep_bonus: float = 0.0  # s: the re-prefill avoided by keeping the form it holds


def option_value(c: Candidate, hidden: bool) -> float:
    """What scheduling the candidate in that form is worth: `p`, less the penalty for HIDDEN,
    plus the keep bonus in the form it already holds."""
    value = c.value - c.hidden_penalty if hidden else c.value
    return value + c.keep_bonus if c.holds_hidden is hidden else value


@dataclass(frozen=True)
class Choice:
    scheduled: bool = False
    hidden: bool = False


SKIP = Choice()
KV = Choice(True, False)
HIDDEN = Choice(True, True)


def options(c: Candidate, capacity: int) -> tuple[tuple[int, float, Choice], ...]:
    """The candidate's useful options as (blocks, value, choice), increasing in blocks and in
    value with non-increasing value per block: what cannot fit alone, what is worth nothing
    and what lies below the upper concave hull of (0, 0), HIDDEN and KV is dropped.

    Written out for its two points (KV, HIDDEN) rather than as a general hull: the simulator
    calls it for every request of every iteration, and it was a third of a probe's time
    (docs/aptserve.md, "The simulator's hot spot"); `tests/engine/scheduling/test_knapsack.py`
    checks it against the general hull."""
    kv_value = c.value + c.keep_bonus if c.holds_hidden is False else c.value
    kv = (c.kv_blocks, kv_value, KV) if c.kv_blocks <= capacity and kv_value > 0 else None
    if c.hidden_blocks is None or c.hidden_blocks > capacity:
        return (kv,) if kv is not None else ()
    hidden_value = c.value - c.hidden_penalty
    if c.holds_hidden is True:
        hidden_value += c.keep_bonus
    if hidden_value <= 0:
        return (kv,) if kv is not None else ()
    hidden = (c.hidden_blocks, hidden_value, HIDDEN)
    if kv is None:
        return (hidden,)
    # fewer blocks first, then the larger value; a full tie keeps KV first (a stable sort)
    a, b = (kv, hidden) if (kv[0], -kv[1]) <= (hidden[0], -hidden[1]) else (hidden, kv)
    if b[1] <= a[1]:
        return (a,)  # more blocks for no more value
    if _below_chord(a, b, (0, 0.0)):
        return (b,)  # a lies below the chord from (0, 0) to b
    return (a, b)


def _below_chord(mid, last, first) -> bool:
    """`mid` strictly below the segment first -> last (value per block would rise after it)."""
    return (mid[1] - first[1]) * (last[0] - first[0]) < (last[1] - first[1]) * (mid[0] - first[0])


def solve(candidates: Sequence[Candidate], capacity: int) -> list[Choice]:
    """Algorithm 1 with the decisions above: a choice per candidate, in order."""
    opts = [options(c, capacity) for c in candidates]
    steps = []  # (-θ, step rank, request, choice, Δblocks, Δvalue)
    for i, chain in enumerate(opts):
        prev_blocks, prev_value = 0, 0.0
        for rank, (blocks, value, choice) in enumerate(chain):
            dm, dv = blocks - prev_blocks, value - prev_value
            steps.append((-dv / dm, rank, i, choice, dm, dv))
            prev_blocks, prev_value = blocks, value
    steps.sort(key=_step_order)
    chosen = [SKIP] * len(candidates)
    taken = [0] * len(candidates)  # increments taken per request: a chain is taken in order
    used, total = 0, 0.0
    for _, rank, i, choice, dm, dv in steps:
        if taken[i] != rank or used + dm > capacity:
            continue  # past the critical increment: skip, keep filling (module docstring)
        used, total, taken[i] = used + dm, total + dv, rank + 1
        chosen[i] = choice
    best = _best_single(opts)
    if best is not None and best[1] > total:
        single = [SKIP] * len(candidates)
        single[best[0]] = best[2]
        return single
    return chosen


def _step_order(step: tuple) -> tuple:
    return step[0], step[1], step[2]


def _best_single(opts: Sequence[tuple[tuple[int, float, Choice], ...]]) -> tuple[int, float, Choice] | None:
    """The best single request in its best feasible form, from each candidate's options."""
    best = None
    for i, chain in enumerate(opts):
        for _, value, choice in chain:
            if best is None or value > best[1]:
                best = (i, value, choice)
    return best


def objective(candidates: Sequence[Candidate], choices: Sequence[Choice]) -> tuple[float, int]:
    """(total value, total blocks) of a choice per candidate."""
    value, blocks = 0.0, 0
    for c, ch in zip(candidates, choices, strict=True):
        if ch.scheduled:
            value += option_value(c, ch.hidden)
            blocks += c.hidden_blocks if ch.hidden else c.kv_blocks
    return value, blocks
