"""Per-token deadlines and slack for RT requests (BROS §4.2), with token-group size 1.

The next token's deadline is `last token time + TPOT` (or `arrival + TTFT` before the first
token), so the paper's slack `s = T_SLO − t − (k − 1)·T_avg` with k = 1 is `deadline − now`:
ordering by slack is ordering by a deadline that only changes when a request emits a token.
That is what makes merge-polling exact: waiting requests (FIFO, one TTFT target) are already
in deadline order, so only the pending ones are sorted and the two runs are merged.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

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


def merge_by_deadline(waiting: Iterable[Request], pending: Iterable[Request], default: SLO) -> list[Request]:
    """Merge-polling: FIFO waiting requests (sorted only if per-request TTFTs or requeued
    requests broke the order; Timsort then costs one linear pass when they did not) and
    sorted pending requests, merged by deadline."""
    key = lambda r: deadline(r, default)  # noqa: E731
    waiting = list(waiting)
    if any(key(a) > key(b) for a, b in zip(waiting, waiting[1:])):
        waiting.sort(key=key)
    return list(heapq.merge(waiting, sorted(pending, key=key), key=key))
