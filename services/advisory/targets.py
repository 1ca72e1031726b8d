"""Target policies: which worker a hinted session's next turn should run on.

Pure functions of the candidates' load, so they are unit-tested without processes.
`least-loaded` (default): the worker with the lowest (RT load + BE load / 4 + pending hints) per
sequence slot, where pending hints are turns already advised to that worker that have not arrived
yet (Symphony's pitfall: without them a burst of hints all lands on the emptiest worker). The
holder wins ties (no transfer needed), so a session moves only to a strictly less loaded worker.
Workers above the KV high-water mark are skipped while any other has room.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    running: float = 0.0  # RT running + waiting, plus BE / 4 (telemetry)
    pending: int = 0  # advised turns placed here that have not arrived yet
    kv_usage: float = 0.0
    max_num_seqs: int = 128

    @property
    def score(self) -> float:
        return (self.running + self.pending) / max(1, self.max_num_seqs)


class TargetPolicy(ABC):
    name: ClassVar[str]

    def __init__(self, kv_high_water: float = 0.95) -> None:
        self.kv_high_water = kv_high_water

    @abstractmethod
    def pick(self, holder: str | None, candidates: Sequence[Candidate]) -> str | None:
        """The target worker id, or None when there is no candidate."""


class LeastLoadedTarget(TargetPolicy):
    name = "least-loaded"

    def pick(self, holder: str | None, candidates: Sequence[Candidate]) -> str | None:
        roomy = [c for c in candidates if c.kv_usage < self.kv_high_water] or list(candidates)
        if not roomy:
            return None
        return min(roomy, key=lambda c: (c.score, c.worker_id != holder, c.worker_id)).worker_id


class HolderTarget(TargetPolicy):
    """Sticky: always the holder when it is a candidate (the benchmark's "sticky sessions" mode)."""

    name = "holder"

    def pick(self, holder: str | None, candidates: Sequence[Candidate]) -> str | None:
        if any(c.worker_id == holder for c in candidates):
            return holder
        return LeastLoadedTarget(self.kv_high_water).pick(holder, candidates)


_POLICIES: dict[str, Callable[[float], TargetPolicy]] = {p.name: p for p in (LeastLoadedTarget, HolderTarget)}


def make_target_policy(name: str, kv_high_water: float = 0.95) -> TargetPolicy:
    try:
        return _POLICIES[name](kv_high_water)
    except KeyError:
        raise ValueError(f"unknown target policy {name!r}; available: {sorted(_POLICIES)}") from None
