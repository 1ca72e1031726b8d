"""Send a periodic report only when it says something new, or when a keepalive is due.

A periodic report that repeats itself (an idle worker's telemetry: no load, the same KV, nothing
finished) costs every reader a wake-up and 2-3 fetches on the embedded broker while telling
nothing. Readers that keep the latest report without judging its age lose nothing when the
repeats are left out; the keepalive still reaches a reader that started since the last change.
"""

from __future__ import annotations

import time

from shared.schemas.base import WireModel


class RepeatFilter:
    """`worth_sending(msg)` before a send, `sent(msg)` after it; `exclude`: fields that change
    every time without news (the send time)."""

    def __init__(self, keepalive_s: float, exclude: frozenset[str] = frozenset({"sent_at"})) -> None:
        self.keepalive_s = keepalive_s
        self._exclude = set(exclude)
        self._last: dict | None = None
        self._last_at = float("-inf")  # monotonic

    def worth_sending(self, msg: WireModel, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now - self._last_at >= self.keepalive_s or msg.model_dump(exclude=self._exclude) != self._last

    def sent(self, msg: WireModel, now: float | None = None) -> None:
        self._last = msg.model_dump(exclude=self._exclude)
        self._last_at = time.monotonic() if now is None else now
