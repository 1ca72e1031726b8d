"""The session directory and the placement book, as the advisory service and the scheduler keep them.

Both are rebuilt from compacted topics (`sessions.directory`, `sessions.placement`) at start-up
and then follow them, so every reader converges on the same view:

- `SessionDirectory`: per session, the copy each worker holds (`SessionLocation`). The holder
  is the live copy with the latest `last_activity`: after a turn the serving worker's copy is
  the newest (it has the grown conversation); older copies elsewhere stay usable as fallbacks.
- `PlacementBook`: per session, the advisory service's latest `SessionPlacement` (a tombstone
  removes it); a placement past `expires_at` counts as absent.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Container

from shared.schemas.sessions import SessionLocation, SessionPlacement


class SessionDirectory:
    def __init__(self, max_sessions: int = 1_000_000) -> None:
        self._copies: OrderedDict[str, dict[str, SessionLocation]] = OrderedDict()  # least recent first
        self._max = max_sessions

    def apply(self, loc: SessionLocation) -> None:
        copies = self._copies.setdefault(loc.session_id, {})
        old = copies.get(loc.worker_id)
        if old is not None and old.last_activity > loc.last_activity:
            return  # reordered update: keep the newer one
        if loc.dropped:
            copies.pop(loc.worker_id, None)
        else:
            copies[loc.worker_id] = loc
        if not copies:
            del self._copies[loc.session_id]
            return
        self._copies.move_to_end(loc.session_id)
        while len(self._copies) > self._max:
            self._copies.popitem(last=False)

    def copies(self, session_id: str | None) -> list[SessionLocation]:
        """Every worker's copy, newest first."""
        found = self._copies.get(session_id or "", {})
        return sorted(found.values(), key=lambda c: (-c.last_activity, c.worker_id))

    def holder(self, session_id: str | None, live: Container[str] | None = None) -> SessionLocation | None:
        """The newest copy, among workers in `live` when given."""
        return next((c for c in self.copies(session_id) if live is None or c.worker_id in live), None)

    def session_ids(self) -> list[str]:
        """Sessions with at least one copy, least recently active first."""
        return list(self._copies)

    def __len__(self) -> int:
        return len(self._copies)


class PlacementBook:
    def __init__(self) -> None:
        self._by_session: dict[str, SessionPlacement] = {}

    def apply(self, session_id: str, placement: SessionPlacement | None) -> None:
        if placement is None:
            self._by_session.pop(session_id, None)
        else:
            self._by_session[session_id] = placement

    def live(self, session_id: str | None, now: float | None = None) -> SessionPlacement | None:
        p = self._by_session.get(session_id or "")
        if p is None or p.expires_at <= (time.time() if now is None else now):
            return None
        return p

    def expired(self, now: float | None = None) -> list[SessionPlacement]:
        now = time.time() if now is None else now
        return [p for p in self._by_session.values() if p.expires_at <= now]

    def __len__(self) -> int:
        return len(self._by_session)
