"""Host-memory copies of kept sessions: per (session, layer) CPU tensors under a byte budget.

Each layer is its own tensor `[2, kv_heads, num_tokens, head_dim]`, so evicting one layer
frees its memory. Tensors are never modified after `put` (a new turn replaces them), which is
what lets the disk writer and the layer loader read them from other threads without locks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.sessions.eviction import EvictionCandidate, EvictionPolicy


@dataclass
class HostCopy:
    layers: list[torch.Tensor | None]
    last_activity: float
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(_nbytes(t) for t in self.layers)

    def drop_layer(self, layer: int) -> int:
        freed = _nbytes(self.layers[layer])
        self.layers[layer] = None
        self.nbytes -= freed
        return freed

    @property
    def empty(self) -> bool:
        return self.nbytes == 0 and all(t is None for t in self.layers)


class HostTier:
    def __init__(self, budget_bytes: int, policy: EvictionPolicy, *, whole_sessions: bool = False) -> None:
        """`whole_sessions`: evicting any layer drops the session's whole copy (used when
        there is no disk tier to complete a partial copy from)."""
        if budget_bytes < 0:
            raise ValueError(f"the session host budget must be >= 0 (got {budget_bytes} bytes)")
        self.budget_bytes = budget_bytes
        self.policy = policy
        self.whole_sessions = whole_sessions
        self._copies: dict[str, HostCopy] = {}
        self.nbytes = 0

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._copies

    def put(self, session_id: str, layers: list[torch.Tensor], last_activity: float) -> None:
        self.drop(session_id)
        copy = HostCopy(list(layers), last_activity)
        self._copies[session_id] = copy
        self.nbytes += copy.nbytes

    def layer(self, session_id: str, layer: int) -> torch.Tensor | None:
        copy = self._copies.get(session_id)
        return None if copy is None else copy.layers[layer]

    def layers_held(self, session_id: str) -> int:
        copy = self._copies.get(session_id)
        return 0 if copy is None else sum(t is not None for t in copy.layers)

    def drop(self, session_id: str) -> None:
        copy = self._copies.pop(session_id, None)
        if copy is not None:
            self.nbytes -= copy.nbytes

    def evict_to_budget(self, is_busy: Callable[[str], bool]) -> list[tuple[str, int]]:
        """Evict in policy order until within budget; returns the (session, layer) copies dropped."""
        if self.nbytes <= self.budget_bytes:
            return []
        evicted = []
        for c in self.policy.order(self._candidates(is_busy)):
            if self.nbytes <= self.budget_bytes:
                break
            copy = self._copies.get(c.session_id)
            if copy is None:  # already dropped whole
                continue
            evicted.extend(self._evict(c.session_id, c.layer, copy))
        return evicted

    def _evict(self, session_id: str, layer: int, copy: HostCopy) -> list[tuple[str, int]]:
        if self.whole_sessions:
            self.drop(session_id)
            return [(session_id, i) for i, t in enumerate(copy.layers) if t is not None]
        self.nbytes -= copy.drop_layer(layer)
        if copy.empty:
            del self._copies[session_id]
        return [(session_id, layer)]

    def _candidates(self, is_busy: Callable[[str], bool]) -> list[EvictionCandidate]:
        out = []
        for sid, copy in self._copies.items():
            busy = is_busy(sid)
            out.extend(
                EvictionCandidate(sid, i, _nbytes(t), busy, copy.nbytes, copy.last_activity)
                for i, t in enumerate(copy.layers)
                if t is not None
            )
        return out


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
