"""The keeper: what a session keeps after a turn, and the host and disk budgets.

After a turn the session keeps the full blocks of prompt + output that have KV, in logical
order. They are gathered into one CPU tensor per layer (the host copy) and queued for the
disk writer, then the budgets are applied: the host tier evicts (session, layer) copies in
its policy's order, and the disk budget drops whole sessions, least recently active first.
Copies are inclusive: with a disk tier, evicting from host never loses a session; without
one, a partial host copy is useless and goes whole.

Busy sessions (a turn in flight or a prefetch pin) are passed over by both budgets: their
next request is the nearest.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.kv.prefix_hash import salt_root
from engine.sessions.catalog import KeptSession, SessionCatalog
from engine.sessions.disk_tier import BaseDiskTier
from engine.sessions.host_tier import HostTier
from engine.sessions.kvfile import KVHeader, KVLayout, iter_layers, read_header
from engine.sessions.pins import PinBook
from engine.sessions.records import SessionStats
from engine.sessions.turns import TurnBook

if TYPE_CHECKING:
    from engine.kv import KVCacheManager, KVCacheStorage
    from engine.scheduling import Request

log = logging.getLogger(__name__)


class SessionKeeper:
    """Engine thread only."""

    def __init__(
        self,
        kv: KVCacheManager,
        storage: KVCacheStorage,
        layout: KVLayout,
        catalog: SessionCatalog,
        host: HostTier,
        disk: BaseDiskTier,
        pins: PinBook,
        turns: TurnBook,
        stats: SessionStats,
    ) -> None:
        self.kv = kv
        self.storage = storage
        self.layout = layout
        self.block_size = layout.block_size
        self.catalog = catalog
        self.host = host
        self.disk = disk
        self.pins = pins
        self.turns = turns
        self.stats = stats

    def is_busy(self, session_id: str) -> bool:
        return self.turns.in_flight(session_id) or self.pins.has_prefetch(session_id)

    # -- after a turn -------------------------------------------------------------------

    def keep(self, session_id: str, request: Request) -> None:
        """Store the finished request's grown KV as the session's (before its blocks are freed)."""
        n = self._keepable_blocks(request)
        if n == 0:
            return
        token_ids = tuple(request.token_ids[: n * self.block_size])
        layers = self._copy_to_host(self.kv.table(request).ids[:n])
        now = time.time()
        root = salt_root(request.cache_salt)
        hashes = list(self.kv.block_hashes(request, n))
        self.catalog.keep(KeptSession(session_id, token_ids, hashes, now, root), layers)
        self._write_disk(session_id, token_ids, layers, now, root)
        self._evict_host()
        self.catalog.notify(session_id)

    def _keepable_blocks(self, request: Request) -> int:
        """Leading blocks whose KV is complete and in logical order (not BE-reversed or shared)."""
        if not self.kv.holds(request):
            return 0
        table = self.kv.table(request)
        full = min(request.num_computed_tokens // self.block_size, len(table.blocks))
        n = 0
        while n < full and self.kv.publishable(table, n):
            n += 1
        return n

    def _copy_to_host(self, block_ids: list[int]) -> list[torch.Tensor]:
        """One CPU tensor per layer (own storage, so evicting a layer frees it), gathered as
        whole-block chunks of the `[2*kv_heads, blocks, block_size*D]` view."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.storage.data.device)
        two, kvh, num_blocks, bs, dim = self.storage.layers[0].shape
        shape = (two, kvh, len(block_ids) * bs, dim)
        with torch.no_grad():
            return [
                layer.view(two * kvh, num_blocks, bs * dim).index_select(1, ids).view(shape).to("cpu")
                for layer in self.storage.layers
            ]

    def _write_disk(
        self, session_id: str, token_ids: tuple[int, ...], layers, now: float, hash_root: bytes | None
    ) -> None:
        size = self.disk.file_size(session_id, token_ids, hash_root)
        if not self.disk.fits(size):
            log.warning("session %r (%d bytes) exceeds the disk budget; kept without a disk copy", session_id, size)
            self.disk.delete(session_id)  # its older, shorter file would be stale
            return
        self.enforce_disk_budget(size, exclude=session_id)
        self.disk.write(session_id, token_ids, layers, size, now, hash_root)

    # -- budgets --------------------------------------------------------------------------

    def _evict_host(self) -> None:
        evicted = self.host.evict_to_budget(self.is_busy)
        self.stats.host_layer_evictions += len(evicted)
        for sid in dict.fromkeys(sid for sid, _ in evicted):
            if not self.disk.holds(sid):
                self.host.drop(sid)  # a partial copy with nothing to complete it is useless
            self.catalog.notify(sid)

    def enforce_disk_budget(self, incoming: int, exclude: str | None) -> None:
        """Drop least recently active idle sessions until `incoming` more bytes fit."""
        for sid in self.disk.victims(incoming, exclude, self.is_busy):
            self.forget(sid)
            self.stats.sessions_dropped += 1
            self.catalog.notify(sid)

    def forget(self, session_id: str) -> None:
        """Every tier lets go of the session (its device blocks stay as ordinary cache blocks)."""
        self.catalog.forget(session_id)
        self.pins.release_prefetch(session_id)
        if self.disk.holds(session_id):
            self.disk.delete(session_id)

    # -- files ----------------------------------------------------------------------------

    def collect_writes(self) -> None:
        """Count finished disk writes; a failed one leaves the session without a disk copy."""
        for result in self.disk.take_results():
            self.stats.bytes_written_disk += result.nbytes
            if result.error is not None:
                self.stats.disk_write_failures += 1
                self.catalog.notify(result.session_id)

    def adopt(self, header: KVHeader, path: Path) -> None:
        """A verified file (a peer's copy) replaces whatever the session had here."""
        sid, now = header.session_id, time.time()
        self.forget(sid)
        if not self.disk.install(sid, header, path, now):
            self._adopt_into_host(sid, path, now)  # no disk tier: the layers move to host memory
        self.catalog.add(sid, header.token_ids, now, header.hash_root)
        self.enforce_disk_budget(0, exclude=sid)

    def _adopt_into_host(self, session_id: str, path: Path, now: float) -> None:
        with open(path, "rb") as f:
            layers = list(iter_layers(f, read_header(f, self.layout)))
        path.unlink(missing_ok=True)
        self.host.put(session_id, layers, now)
        self._evict_host()

    def reindex(self) -> None:
        """Index the files a previous process left, then apply the disk budget to them."""
        for header, entry in self.disk.reindex():
            self.catalog.add(header.session_id, header.token_ids, entry.last_activity, header.hash_root)
        self.enforce_disk_budget(0, exclude=None)
