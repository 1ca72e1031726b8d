"""Host-tier eviction policies: which (session, layer) copy leaves host memory first.

Evicting from host never loses a session while the disk tier is on (every kept session has a
disk copy), so the policy only decides what will be slow to promote next time.

The default, "idle-layer-size", follows Symphony (notes §2.6): sessions with no pending hint
and no running turn go first (their next request is furthest away); within a class, later
layers go before earlier ones, because a layer-wise promotion can start computing on early
layers while the late ones still come from disk; then the largest session first (one
eviction frees the most). "lru" evicts whole sessions, least recently active first, last
layer first: the simple baseline to compare against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class EvictionCandidate:
    session_id: str
    layer: int
    nbytes: int  # bytes this layer's copy frees
    busy: bool  # the session has a pending hint (prefetch pin) or a running turn
    session_nbytes: int  # the session's whole host copy
    last_activity: float


class EvictionPolicy(ABC):
    name: ClassVar[str]

    @abstractmethod
    def order(self, candidates: Sequence[EvictionCandidate]) -> list[EvictionCandidate]:
        """Candidates in eviction order (first = evicted first)."""


class IdleLayerSize(EvictionPolicy):
    name = "idle-layer-size"

    def order(self, candidates):
        return sorted(candidates, key=lambda c: (c.busy, -c.layer, -c.session_nbytes, c.last_activity))


class LeastRecentSession(EvictionPolicy):
    name = "lru"

    def order(self, candidates):
        return sorted(candidates, key=lambda c: (c.busy, c.last_activity, c.session_id, -c.layer))


_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {p.name: p for p in (IdleLayerSize, LeastRecentSession)}


def make_eviction_policy(name: str) -> EvictionPolicy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown session eviction policy {name!r}; available: {sorted(_POLICIES)}") from None
