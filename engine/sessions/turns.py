"""Session turns in flight, and what each one reused or computed.

A session with a turn in flight is busy: eviction and the disk budget pass it over, since
its KV is about to be needed (or grown).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.sessions.pins import Pin
from engine.sessions.records import SessionStats

if TYPE_CHECKING:
    from engine.scheduling import Request


@dataclass
class Turn:
    session_id: str
    request: Request
    pin: Pin | None = None  # the promoted blocks; None when nothing of the session was reusable
    kept_tokens_in_prompt: int = 0  # the prompt's common full-block prefix with the kept tokens


class TurnBook:
    """Engine thread only."""

    def __init__(self, block_size: int, stats: SessionStats) -> None:
        self.block_size = block_size
        self.stats = stats
        self._turns: dict[str, Turn] = {}  # request id -> turn
        self._in_flight: Counter[str] = Counter()  # session id -> turns in flight

    def begin(self, request: Request, session_id: str) -> Turn:
        turn = self._turns[request.request_id] = Turn(session_id, request)
        self._in_flight[session_id] += 1
        return turn

    def end(self, request_id: str) -> Turn | None:
        """Stop tracking the turn (None: the request was not a session turn, or already ended)."""
        turn = self._turns.pop(request_id, None)
        if turn is None:
            return None
        self._in_flight[turn.session_id] -= 1
        if self._in_flight[turn.session_id] <= 0:
            del self._in_flight[turn.session_id]
        self._count(turn)
        return turn

    def __contains__(self, request_id: str) -> bool:
        """Whether the request is a turn in flight (partial residency leaves turns fully resident)."""
        return request_id in self._turns

    def in_flight(self, session_id: str) -> bool:
        return session_id in self._in_flight

    def _count(self, turn: Turn) -> None:
        """Reused tokens per tier, computed and recomputed prompt tokens."""
        request, bs = turn.request, self.block_size
        self.stats.turns += 1
        if request.first_scheduled_time is None:
            return  # never admitted: nothing reused or computed
        cached = request.num_cached_tokens
        tiers = turn.pin.block_tiers if turn.pin is not None else []
        for b in range(cached // bs):
            self.stats.tokens_reused[tiers[b] if b < len(tiers) else "gpu"] += bs
        self.stats.tokens_computed += max(0, request.num_prompt_tokens - cached)
        self.stats.tokens_recomputed += max(0, turn.kept_tokens_in_prompt - cached)
