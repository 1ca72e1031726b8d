"""Apt-Serve's runtime quantities (paper §4.2, §5 stage 1; notes §2.5-2.6) as small pure
functions for the coming `aptserve` policy: pending time, the value of scheduling a request
(with SLO demotion), the iteration type and a request's knapsack `Candidate`.

Decisions where the paper is silent:
- *Pending time* of a request that has produced no token is measured from arrival, also while
  it is mid-prefill (chunked) or after a preemption; after its first token, from its last one.
- *Demotion*: a request past its SLO (TTFT before the first token, TBT after) is worth
  `decay × p`; `decay = 0` (the paper's default) means the near-zero `DEMOTED_VALUE`, not 0,
  so demoted requests still use leftover memory in order of age. The paper's "Scheduling*"
  variant is `decay = 0.4`. A request without an SLO is never demoted.
- *The hidden penalty* `c = N·ρ·m̄` counts every outstanding request in N (the paper; its code
  subtracts the demoted ones, which we do not: a slower batch slows them too).
- *The keep bonus* `s = N·t_re` of a running request (not in the paper): `t_re` is the step
  time its re-prefill would add (its computed tokens as one more prefill row), and N scales
  it as N scales the penalty, since that re-prefill delays every outstanding request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from engine.scheduling.knapsack import Candidate
from engine.scheduling.request import SLO, Request

DEMOTED_VALUE = 1e-6  # seconds: "near zero", yet ordered by age (× pending time)
_NO_SLO = SLO()  # a request's "no SLO of its own" (built once: this runs per request per step)


def pending_time(request: Request, now: float) -> float:
    """Seconds since the request last got something: arrival before its first token, its last
    token after."""
    since = request.arrival_time if request.last_token_time is None else request.last_token_time
    return max(0.0, now - since)


def slo_violated(request: Request, now: float, default: SLO = SLO()) -> bool:
    """Past its TTFT (no token yet) or TBT (decoding) target (the request's own, else
    `default`'s); never without one."""
    slo = request.slo if request.slo != _NO_SLO else default
    limit = slo.ttft_s if request.first_token_time is None else slo.tpot_s
    return limit is not None and pending_time(request, now) > limit


def request_value(request: Request, now: float, decay: float = 0.0, default_slo: SLO = SLO()) -> float:
    """`p`, or for a request past its SLO `decay·p` (`DEMOTED_VALUE·p` when decay is 0)."""
    p = pending_time(request, now)
    if not slo_violated(request, now, default_slo):
        return p
    return p * (decay if decay > 0 else DEMOTED_VALUE)


def iteration_type(
    waiting_pending: Iterable[float], running_pending: Iterable[float], waiting_fits: bool
) -> Literal["prefill", "decode"]:
    """Prefill iff the waiting queue's summed pending time exceeds the running queue's and a
    waiting request fits in free memory; decode otherwise (T11)."""
    return "prefill" if waiting_fits and sum(waiting_pending) > sum(running_pending) else "decode"


def make_candidate(
    value: float,
    kv_blocks: int,
    hidden_blocks: int | None,
    outstanding: int,
    rho: float,
    holds_hidden: bool | None = None,
    reprefill_s: float = 0.0,
) -> Candidate:
    """The knapsack item: HIDDEN offered with `hidden_blocks` (None: not offered, e.g. a model
    where it saves no memory) at the penalty `outstanding·ρ·m̄`; a running request that holds
    a form (`holds_hidden`) keeps it for the bonus `outstanding·reprefill_s`."""
    bonus = outstanding * reprefill_s if holds_hidden is not None else 0.0
    return Candidate(value, kv_blocks, hidden_blocks, outstanding * rho * kv_blocks, holds_hidden, bonus)
