"""Effective throughput: the highest request rate whose SLO attainment stays >= a target.

Attainment is assumed to fall as the rate rises (Apt-Serve's "performance wall"). We bracket
the crossing by doubling the rate from `start`, then bisect until the bracket is narrower
than `rel_tol` of its upper end. Every probe is kept: they are the points of the
attainment-vs-rate plot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class EffectiveThroughput:
    rate: float  # highest probed rate meeting the target (0.0 if even the lowest did not)
    target: float
    probes: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment), in probe order
    bracketed: bool = True  # False: the highest rate tried still met the target

    def as_dict(self) -> dict:
        return {
            "rate": self.rate,
            "target": self.target,
            "bracketed": self.bracketed,
            "probes": [{"rate": r, "attainment": a} for r, a in self.probes],
        }


def effective_throughput(
    attainment_at: Callable[[float], float],
    target: float,
    start: float = 1.0,
    max_rate: float = 1024.0,
    rel_tol: float = 0.05,
    max_probes: int = 16,
) -> EffectiveThroughput:
    if not 0.0 < target <= 1.0:
        raise ValueError(f"attainment target must be in (0, 1], got {target}")
    if start <= 0 or max_rate < start:
        raise ValueError(f"need 0 < start <= max_rate, got start={start}, max_rate={max_rate}")
    res = EffectiveThroughput(0.0, target)

    def ok(rate: float) -> bool:
        a = attainment_at(rate)
        res.probes.append((rate, a))
        return a >= target

    lo, hi = _bracket(ok, start, max_rate, max_probes)
    if lo is None:  # even `start` misses: halve down to start/64 to find a rate that meets it
        lo, hi = _bracket_down(ok, start, min(6, max_probes - 1))
        if lo is None:
            return res
    if hi is None:
        res.rate, res.bracketed = lo, False
        return res
    while hi - lo > rel_tol * hi and len(res.probes) < max_probes:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    res.rate = lo
    return res


def _bracket(
    ok: Callable[[float], bool], start: float, max_rate: float, max_probes: int
) -> tuple[float | None, float | None]:
    """(a rate that meets the target, a higher one that does not); None where not found."""
    if not ok(start):
        return None, start
    lo = start
    for _ in range(max_probes - 1):
        if lo >= max_rate:
            break
        hi = min(lo * 2, max_rate)
        if not ok(hi):
            return lo, hi
        lo = hi
    return lo, None


def _bracket_down(ok: Callable[[float], bool], start: float, halvings: int) -> tuple[float | None, float]:
    hi = start
    for _ in range(halvings):
        lo = hi / 2
        if ok(lo):
            return lo, hi
        hi = lo
    return None, hi
