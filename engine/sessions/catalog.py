"""The kept sessions, and what the rest of the system sees of them.

A kept session is its kept tokens (whole blocks with KV) and the prefix-cache hash of each
block: the same chained hashes `match_prefix` uses, so a next turn's reusable prefix is a
comparison of hashes. A salted session (an API key's) chains them from its salt's root, which
its file records, so a re-indexed or pulled copy is still found by that key's next turn and by
nobody else's. The catalog also answers the thread-safe questions (`info`,
`snapshot`: which tiers hold a complete copy) and tells the listeners when a session
changes.

A record and its host copy change together under one lock, so a reader in another thread
never pairs a record with the host copy of another turn.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.kv.block_pool import BlockPool
from engine.kv.prefix_hash import hash_block
from engine.sessions.disk_tier import BaseDiskTier
from engine.sessions.host_tier import HostTier
from engine.sessions.kvfile import KVLayout
from engine.sessions.records import SessionInfo

log = logging.getLogger(__name__)


@dataclass
class KeptSession:
    session_id: str
    token_ids: tuple[int, ...]  # kept tokens: whole blocks with KV
    hashes: list[bytes]  # the prefix-cache hash of each kept block
    last_activity: float  # time.time() of the last turn, prefetch or adoption
    hash_root: bytes | None = None  # the salted chain's root (None: unsalted)


class SessionCatalog:
    def __init__(self, pool: BlockPool, host: HostTier, disk: BaseDiskTier, layout: KVLayout) -> None:
        self.pool = pool
        self.host = host
        self.disk = disk
        self.layout = layout
        self.listeners: list[Callable[[SessionInfo], None]] = []
        self._lock = threading.RLock()  # guards _sessions (and host puts/drops) for the thread-safe readers
        self._sessions: dict[str, KeptSession] = {}

    # -- engine thread ------------------------------------------------------------------

    def get(self, session_id: str) -> KeptSession | None:
        return self._sessions.get(session_id)

    def __len__(self) -> int:
        return len(self._sessions)

    def keep(self, session: KeptSession, host_layers: list[torch.Tensor]) -> None:
        """A turn's grown session: the record and its host copy replace the old ones."""
        with self._lock:
            self._sessions[session.session_id] = session
            self.host.put(session.session_id, host_layers, session.last_activity)

    def add(
        self, session_id: str, token_ids: Sequence[int], last_activity: float, hash_root: bytes | None = None
    ) -> None:
        """Index a session known only by its tokens (a file re-indexed or adopted): hashes them,
        from its file's hash root."""
        hashes, parent, bs = [], hash_root, self.layout.block_size
        for i in range(len(token_ids) // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        with self._lock:
            self._sessions[session_id] = KeptSession(session_id, tuple(token_ids), hashes, last_activity, hash_root)

    def forget(self, session_id: str) -> None:
        """Drop the record and the host copy (other tiers are the caller's business)."""
        with self._lock:
            self._sessions.pop(session_id, None)
            self.host.drop(session_id)

    def notify(self, session_id: str) -> None:
        """Tell the listeners the session's state now (empty tiers: dropped). They must not block."""
        if not self.listeners:
            return
        info = self.info(session_id) or SessionInfo(session_id, 0, (), 0, time.time())
        for listener in self.listeners:
            try:
                listener(info)
            except Exception:  # a listener's bug must not take the engine down
                log.exception("session listener failed")

    # -- thread-safe --------------------------------------------------------------------

    def info(self, session_id: str) -> SessionInfo | None:
        with self._lock:
            session = self._sessions.get(session_id)
            return None if session is None else self._info(session)

    def snapshot(self) -> list[SessionInfo]:
        with self._lock:
            return [self._info(s) for s in self._sessions.values()]

    def _info(self, session: KeptSession) -> SessionInfo:
        sid = session.session_id
        tiers = []
        if session.hashes and all(self.pool.lookup(h) is not None for h in session.hashes):
            tiers.append("gpu")
        if self.host.layers_held(sid) == self.layout.num_layers:
            tiers.append("host")
        if self.disk.holds(sid):
            tiers.append("disk")
        n = len(session.token_ids)
        return SessionInfo(sid, n, tuple(tiers), n * self.layout.bytes_per_token, session.last_activity)
