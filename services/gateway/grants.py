"""The gateway's side of RT dispatch by grant (services/scheduler/grants.py; docs/services.md,
"RT dispatch by grant"): which worker, if any, an RT request may be sent to directly.

`GrantBook` keeps the scheduler's latest grant and the requests this gateway has in flight
through it. A request takes a slot when
- it is RT, a first attempt (a resumed one goes through the scheduler: its worker was lost or
  its stream had a gap, and the scheduler's view decides where it continues), not a session
  turn (affinity and KV pulls need the scheduler's view), and not pinned to a KV source;
- the grant is live (read within its TTL, not revoked);
- a granted worker serves its model, is live in this gateway's own view (heartbeats within the
  worker timeout, not draining, not fenced) at the grant's epoch, and has a free slot.
Among those it takes the worker with the fewest of this gateway's granted requests, then the one
used least often (so sequential requests spread instead of all going to the first). The slot
is released when the request's stream closes (finished, failed, or its client went away).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from shared.live_workers import LiveWorkers
from shared.schemas.grants import PlacementGrant
from shared.schemas.requests import GenerateRequest


@dataclass(frozen=True)
class Slot:
    worker_id: str
    epoch: int
    term: int


class GrantBook:
    def __init__(self, workers: LiveWorkers) -> None:
        self.workers = workers
        self.grant: PlacementGrant | None = None
        self._expires = 0.0  # monotonic
        self._held: dict[str, str] = {}  # request id -> the worker its slot is on
        self._in_flight: Counter[str] = Counter()  # worker id -> this gateway's granted requests there
        self._uses: Counter[str] = Counter()

    def on_grant(self, grant: PlacementGrant) -> bool:
        """Keep `grant` unless a live one of a higher (term, sequence) is held; True if kept.
        An expired grant is replaced by anything: after a broker restart terms start again at 1."""
        now = time.monotonic()
        held = self.grant
        if held is not None and now < self._expires and (grant.term, grant.sequence) < (held.term, held.sequence):
            return False
        self.grant, self._expires = grant, now + grant.ttl_s
        return True

    def clear(self) -> None:
        """Forget the grant (the broker restarted: its scheduler's term means nothing now)."""
        self.grant = None

    def live(self) -> PlacementGrant | None:
        if self.grant is None or time.monotonic() >= self._expires or not self.grant.workers:
            return None
        return self.grant

    def take(self, request: GenerateRequest) -> Slot | None:
        """A slot for `request`, or None: it takes the scheduler's path (module docstring)."""
        if request.req_class != "rt" or request.attempt or request.session_id or request.kv_source:
            return None
        grant = self.live()
        if grant is None:
            return None
        live = self.workers.live()
        open_ = [
            g
            for g in grant.workers
            if g.model == request.model
            and g.worker_id in live
            and live[g.worker_id].heartbeat.epoch == g.epoch
            and self._in_flight[g.worker_id] < g.slots
        ]
        if not open_:
            return None
        g = min(open_, key=lambda g: (self._in_flight[g.worker_id], self._uses[g.worker_id], g.worker_id))
        self._held[request.request_id] = g.worker_id
        self._in_flight[g.worker_id] += 1
        self._uses[g.worker_id] += 1
        return Slot(g.worker_id, g.epoch, grant.term)

    def release(self, request_id: str) -> None:
        worker = self._held.pop(request_id, None)
        if worker is not None:
            self._in_flight[worker] -= 1

    def granted_workers(self) -> int:
        grant = self.live()
        return len(grant.workers) if grant is not None else 0
