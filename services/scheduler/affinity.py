"""Session affinity: which worker a session's next turn should prefer.

The hook the advisory service plugs into. The default remembers the worker that served each
session's last turn, since that worker's prefix cache still holds the conversation; placement
honours the preference only while that worker has room. The advisory issue replaces this with
its session directory (placements chosen from typing hints and KV tiers).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict


class SessionAffinity(ABC):
    @abstractmethod
    def preferred(self, session_id: str | None) -> str | None:
        """The worker id the session should go to, if any."""

    @abstractmethod
    def placed(self, session_id: str | None, worker_id: str) -> None:
        """A turn of the session was dispatched to `worker_id`."""


class LastWorkerAffinity(SessionAffinity):
    def __init__(self, max_sessions: int = 100_000) -> None:
        self._last: OrderedDict[str, str] = OrderedDict()
        self._max = max_sessions

    def preferred(self, session_id: str | None) -> str | None:
        return None if session_id is None else self._last.get(session_id)

    def placed(self, session_id: str | None, worker_id: str) -> None:
        if session_id is None:
            return
        self._last[session_id] = worker_id
        self._last.move_to_end(session_id)
        while len(self._last) > self._max:
            self._last.popitem(last=False)
