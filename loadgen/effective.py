"""Effective throughput: the highest request rate whose SLO attainment stays >= a target.

Attainment is assumed to fall as the rate rises (Apt-Serve's "performance wall"). We bracket
the crossing by doubling the rate from `start`, then bisect until the bracket is narrower
than `rel_tol` of its upper end. Every probe is kept: they are the points of the
attainment-vs-rate plot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loadgen.metrics import RequestRecord, slo_ok


@dataclass
class EffectiveThroughput:
    rate: float  # highest probed rate meeting the target (0.0 if even the lowest did not)
    target: float
    probes: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment), in probe order
    bracketed: bool = True  # False: the highest rate tried still met the target
    # probes stopped once they could no longer meet the target (`MissBound`): their attainment
    # in `probes` is an upper bound, not a measurement
    stopped_early: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        early = set(self.stopped_early)
        return {
            "rate": self.rate,
            "target": self.target,
            "bracketed": self.bracketed,
            "probes": [
                {"rate": r, "attainment": a, **({"attainment_at_most": True} if r in early else {})}
                for r, a in self.probes
            ],
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


class MissBound:
    """Stops an effective-throughput probe once it can no longer meet the target.

    The bisection needs only whether a probe's attainment is >= the target. A probe past the
    wall (aptserve at 16 req/s, every one of 1,000 requests served to its end, as the paper's
    client does) spends most of its time serving requests whose outcome cannot change that
    answer. A request is a *certain miss* once it closed without meeting its SLO, or once it
    is open with no token past its TTFT SLO (or its first token came late): whatever happens
    next, it misses. When the certain misses of a window of `total` requests make
    `(total - misses) / total < target`, the probe fails for sure and the run can stop; its
    attainment is then known only as at most that bound, which is what the probe records
    (`EffectiveThroughput.stopped_early` lists such rates). Certain P99-TBT misses of open
    requests are not counted (a late gap may still fall under the P99), so the bound is
    conservative: a probe is never stopped that could still pass.

    Called by the driver with the run's records and the target's clock; it rescans at most
    once per `every_s` of that clock (a scan is over every record)."""

    def __init__(self, target: float, total: int, every_s: float = 1.0) -> None:
        if total <= 0:
            raise ValueError(f"MissBound needs the window's request count, got {total}")
        self.target, self.total, self.every_s = target, total, every_s
        self.misses = 0
        self._next_check = 0.0

    @property
    def at_most(self) -> float:
        """The highest attainment the run can still reach."""
        return (self.total - self.misses) / self.total

    def __call__(self, records: Iterable[RequestRecord], now: float) -> bool:
        if now < self._next_check:
            return False
        self._next_check = now + self.every_s
        self.misses = sum(1 for r in records if _certain_miss(r, now))
        return self.at_most < self.target


def _certain_miss(rec: RequestRecord, now: float) -> bool:
    if rec.slo_ttft_s is None and rec.slo_tpot_s is None:
        return False  # no SLO: not in the attainment's denominator
    if rec.finish_s is not None:
        return not slo_ok(rec)
    if rec.slo_ttft_s is None:
        return False
    if rec.token_times_s:
        return rec.token_times_s[0] - rec.arrival_s > rec.slo_ttft_s
    return now - rec.arrival_s > rec.slo_ttft_s  # its first token can come only later
