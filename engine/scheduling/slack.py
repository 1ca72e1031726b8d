"""Per-token deadlines and slack for RT requests (BROS §4.2), with token-group size 1.

The next token's deadline is `last token time + TPOT` (or `arrival + TTFT` before the first
token), so the paper's slack `s = T_SLO − t − (k − 1)·T_avg` with k = 1 is `deadline − now`:
ordering by slack is ordering by a deadline that only changes when a request emits a token.
That is what makes merge-polling exact: waiting requests (FIFO, one TTFT target) are already
in deadline order, so only the pending ones are sorted and the two runs are merged.
"""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Callable, Iterable

from engine.scheduling.request import SLO, Request


def target(request: Request, default: SLO) -> float:
    """The SLO of the request's next token: TTFT for the first, TPOT for every later one."""
    slo = request.slo
    if request.first_token_time is None:
        return slo.ttft_s if slo.ttft_s is not None else default.ttft_s
    return slo.tpot_s if slo.tpot_s is not None else default.tpot_s


def deadline(request: Request, default: SLO) -> float:
    start = request.arrival_time if request.last_token_time is None else request.last_token_time
    return start + target(request, default)


def merge_by_deadline(
    waiting: Iterable[Request],
    pending: Iterable[Request],
    default: SLO,
    key: Callable[[Request], float] | None = None,
) -> list[Request]:
    """Merge-polling: FIFO waiting requests (sorted only if per-request TTFTs or requeued
    requests broke the order; Timsort then costs one linear pass when they did not) and
    sorted pending requests, merged by deadline (or by `key`, e.g. a token group's latest
    start, which for a waiting request is its TTFT deadline)."""
    key = key or (lambda r: deadline(r, default))
    waiting = list(waiting)
    if any(key(a) > key(b) for a, b in zip(waiting, waiting[1:])):
        waiting.sort(key=key)
    return list(heapq.merge(waiting, sorted(pending, key=key), key=key))


class TokenGroups:
    """Token groups of `size` tokens (BROS eq. 6 with k_i > 1; the paper names the metric but
    never defines it, notes "token group").

    Our reading, as a streaming user would expect it: the first token keeps its TTFT deadline;
    after it, output tokens come in groups of `size`, and a group must be complete within
    `size x TPOT` of the moment the previous group completed (the first token's time for the
    first group). So a request may fall behind within a group (a BE-heavy step) as long as the
    group as a whole lands on time. With `k` tokens of the group left, the request's slack is
    `group deadline - now - (k - 1) x T_avg` (eq. 6: the rest of the group runs back to back).
    `size = 1` is the per-token deadline of the plain `deadline` above.

    Group starts are recorded by `observe` after each step (weakly keyed: a finished request's
    entry goes with it).
    """

    def __init__(self, size: int = 1) -> None:
        if size < 1:
            raise ValueError(f"token group size must be >= 1, got {size}")
        self.size = size
        self._start: weakref.WeakKeyDictionary[Request, float] = weakref.WeakKeyDictionary()

    def observe(self, request: Request) -> None:
        """Call after a step in which `request` got a token: a completed group starts the next."""
        if self.size > 1 and request.first_token_time is not None and self._done(request) == 0:
            self._start[request] = request.last_token_time

    def left(self, request: Request) -> int:
        """k_i: tokens left in the current group (1 before the first token)."""
        if request.first_token_time is None:
            return 1
        return self.size - self._done(request)

    def deadline(self, request: Request, default: SLO) -> float:
        if self.size == 1 or request.first_token_time is None:
            return deadline(request, default)
        start = self._start.get(request, request.first_token_time)
        return start + self.size * target(request, default)

    def slack(self, request: Request, default: SLO, now: float, t_avg: float | None) -> float:
        return self.deadline(request, default) - now - (self.left(request) - 1) * (t_avg or 0.0)

    def _done(self, request: Request) -> int:
        """Tokens of the current group already out (the first token belongs to no group)."""
        return (request.num_output_tokens - 1) % self.size
