"""Session affinity: where a session's turn runs, and where that worker can get the session's KV.

One interface, three policies (`TANDEM_SESSION_ROUTING`):

- `advisory` (default, Symphony): a turn goes to its session's unexpired placement (chosen by
  the advisory service from a typing hint, the KV already prefetched there) while that worker
  has a free sequence slot. A turn with no placement goes to the holder (the worker with the
  newest copy of the session's KV) when the holder has room and is at most `holder_slack`
  requests' worth of load above the least-loaded live worker (the KV location is worth a
  bounded amount of load, the rule `placement.LeastLoaded` uses; before, "has room" alone made
  unhinted turns sticky until the holder was three-quarters full); otherwise the placement policy
  picks the least-loaded worker and the request carries `kv_source` = the holder, so that
  worker pulls the KV or recomputes it, whichever its cost model says is faster.
- `sticky`: always the holder while it lives, busy or not (InferCept-style; the benchmark's
  baseline). Turns that must move (holder gone) still get `kv_source`.
- `none`: no affinity, no KV hints: every turn is balanced like any request.

The holder comes from the `sessions.directory` topic (workers publish their copies) or, when a
turn was dispatched after the directory's newest entry (its worker has not published the grown
KV yet), from the scheduler's own memory of that dispatch.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import ClassVar

from services.scheduler.placement import WorkerLoad, rt_load_score, within_holder_slack
from shared.schemas.sessions import KVSourceRef, SessionLocation, SessionPlacement, session_kv_url
from shared.session_state import PlacementBook, SessionDirectory


@dataclass(frozen=True)
class AffinityLimits:
    holder_room: float = 0.75  # the holder has room below this share of its sequence slots in RT
    kv_high_water: float = 0.9  # ... and below this KV use, with no RT waiting
    holder_slack: float = 4.0  # ... and at most this many requests' load above the least-loaded


class SessionAffinity(ABC):
    name: ClassVar[str]

    def __init__(self, limits: AffinityLimits = AffinityLimits(), max_sessions: int = 100_000) -> None:
        self.limits = limits
        self.directory = SessionDirectory(max_sessions)
        self.placements = PlacementBook()
        self._last: OrderedDict[str, tuple[str, float]] = OrderedDict()  # session -> (worker, dispatched at)
        self._max = max_sessions
        self._advisory_term = 0  # the highest advisory lease term on a placement read

    # -- inputs ------------------------------------------------------------------------------

    def on_location(self, loc: SessionLocation) -> None:
        self.directory.apply(loc)

    def forget_terms(self) -> None:
        """The broker restarted: its `leases` topic starts again at term 1, so the advisory term
        read before means nothing (a placement of the new history would be dropped)."""
        self._advisory_term = 0

    def on_placement(self, session_id: str, placement: SessionPlacement | None) -> None:
        if placement is not None:
            if placement.term < self._advisory_term:
                return  # a deposed advisory service's late placement: its successor decides
            self._advisory_term = placement.term
        self.placements.apply(session_id, placement)

    def placed(self, session_id: str | None, worker_id: str) -> None:
        """A turn of the session was dispatched to `worker_id`."""
        if session_id is None:
            return
        self._last[session_id] = (worker_id, time.time())
        self._last.move_to_end(session_id)
        while len(self._last) > self._max:
            self._last.popitem(last=False)

    # -- decisions ---------------------------------------------------------------------------

    @abstractmethod
    def route(self, session_id: str | None, loads: Sequence[WorkerLoad]) -> str | None:
        """The worker an RT turn of the session must go to, or None: the placement policy decides."""

    def kv_source(self, session_id: str | None, worker_id: str, live: Container[str]) -> KVSourceRef | None:
        """Where `worker_id` can pull the session's KV from, when a live peer has a newer copy."""
        newest = self.directory.holder(session_id, live)
        if newest is None or newest.worker_id == worker_id or newest.kv_url is None:
            return None
        own = next((c for c in self.directory.copies(session_id) if c.worker_id == worker_id), None)
        if own is not None and own.num_tokens >= newest.num_tokens:
            return None
        return KVSourceRef(
            worker_id=newest.worker_id,
            url=session_kv_url(newest.kv_url, newest.session_id),
            num_tokens=newest.num_tokens,
        )

    def holder(self, session_id: str | None, live: Container[str]) -> str | None:
        """The live worker with the newest KV of the session (directory, or our own later dispatch)."""
        newest = self.directory.holder(session_id, live)
        last = self._last.get(session_id or "")
        if last is not None and last[0] in live and (newest is None or last[1] > newest.last_activity):
            return last[0]
        return newest.worker_id if newest else None

    def has_room(self, w: WorkerLoad) -> bool:
        return (
            w.waiting_rt == 0
            and w.rt < self.limits.holder_room * w.max_num_seqs
            and w.kv_usage < self.limits.kv_high_water
        )


class AdvisoryAffinity(SessionAffinity):
    name = "advisory"

    def route(self, session_id: str | None, loads: Sequence[WorkerLoad]) -> str | None:
        if session_id is None:
            return None
        by_id = {w.worker_id: w for w in loads if not w.draining}
        placement = self.placements.live(session_id)
        if placement is not None:
            target = by_id.get(placement.worker_id)
            if target is not None and target.rt < target.max_num_seqs:
                return target.worker_id  # prefetched there; honoured unless it has no sequence slot
        holder = by_id.get(self.holder(session_id, by_id) or "")
        if holder is None or not self.has_room(holder):
            return None
        least = min(by_id.values(), key=rt_load_score)
        return holder.worker_id if within_holder_slack(holder, least, self.limits.holder_slack) else None


class StickyAffinity(SessionAffinity):
    name = "sticky"

    def route(self, session_id: str | None, loads: Sequence[WorkerLoad]) -> str | None:
        live = {w.worker_id for w in loads if not w.draining}
        return self.holder(session_id, live) if session_id is not None else None


class NoAffinity(SessionAffinity):
    name = "none"

    def route(self, session_id: str | None, loads: Sequence[WorkerLoad]) -> str | None:
        return None

    def kv_source(self, session_id: str | None, worker_id: str, live: Container[str]) -> KVSourceRef | None:
        return None


_AFFINITIES: dict[str, Callable[[AffinityLimits], SessionAffinity]] = {
    a.name: a for a in (AdvisoryAffinity, StickyAffinity, NoAffinity)
}


def make_affinity(name: str, limits: AffinityLimits = AffinityLimits()) -> SessionAffinity:
    try:
        return _AFFINITIES[name](limits)
    except KeyError:
        raise ValueError(f"unknown session affinity {name!r}; available: {sorted(_AFFINITIES)}") from None
