"""Promotion: put a session's reusable kept blocks on the device before its request runs.

Blocks the pool still has (found by hash) only get a reference. Blocks it has lost are
allocated from the free list, registered under their hashes at once (so `match_prefix` finds
them), and filled layer by layer in the background by the `LayerLoader`, each layer from the
host copy when the host tier still has it, else from the session's file. Reuse stops at the
first block that can be neither found nor loaded; the rest is recomputed.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from engine.kv.block_pool import Block
from engine.sessions.catalog import KeptSession
from engine.sessions.disk_tier import BaseDiskTier
from engine.sessions.host_tier import HostTier
from engine.sessions.kvfile import KVLayout
from engine.sessions.loader import LayerLoad, LayerLoader
from engine.sessions.loads import LoadTracker
from engine.sessions.pins import Pin
from engine.sessions.records import SessionStats

if TYPE_CHECKING:
    from engine.kv import KVCacheManager
    from engine.scheduling import Request


class Promoter:
    """Engine thread only."""

    def __init__(
        self,
        kv: KVCacheManager,
        host: HostTier,
        disk: BaseDiskTier,
        layout: KVLayout,
        loader: LayerLoader,
        loads: LoadTracker,
        stats: SessionStats,
    ) -> None:
        self.kv = kv
        self.pool = kv.pool
        self.host = host
        self.disk = disk
        self.layout = layout
        self.block_size = layout.block_size
        self.loader = loader
        self.loads = loads
        self.stats = stats

    def common_blocks(self, session: KeptSession, request: Request) -> int:
        """Kept blocks the prompt starts with (at least one prompt token is left to compute)."""
        limit = min(len(session.hashes), (request.num_tokens - 1) // self.block_size)
        mine = self.kv.block_hashes(request, limit)
        n = 0
        while n < limit and mine[n] == session.hashes[n]:
            n += 1
        return n

    def promote(self, session: KeptSession, n: int) -> Pin:
        """Pin the session's first n blocks on the device, loading the ones the pool lost."""
        loadable = self._loadable(session.session_id)
        pin = Pin(session.session_id, [], [])
        if not self.pool.enable_caching:
            return pin  # nothing could find the blocks: reuse needs the prefix cache
        missing: list[tuple[int, Block]] = []
        for i, h in enumerate(session.hashes[:n]):
            block = self.pool.lookup(h)
            if block is not None:
                self.pool.acquire([block])
                pin.block_tiers.append("gpu")
            elif loadable and self.pool.num_free > 0:
                block = self.pool.allocate(1)[0]
                self.pool.register(block, h)
                missing.append((i, block))
                pin.block_tiers.append("")  # filled in below, once the load's source is known
            else:
                break  # reuse stops here; the rest is recomputed
            pin.blocks.append(block)
        if missing:
            pin.load = self._start_load(session, missing)
            pin.block_tiers = [t or pin.tier for t in pin.block_tiers]
        return pin

    def _loadable(self, session_id: str) -> bool:
        """A complete copy exists below the device: the file, or every layer on host."""
        return self.disk.holds(session_id) or self.host.layers_held(session_id) == self.layout.num_layers

    def _start_load(self, session: KeptSession, missing: list[tuple[int, Block]]) -> LayerLoad:
        sid, bs = session.session_id, self.block_size
        file = self.disk.file_of(sid)
        last = missing[-1][0] + 1
        load = LayerLoad(
            sid,
            [b.block_id for _, b in missing],
            [i for i, _ in missing],
            [self.host.layer(sid, i) for i in range(self.layout.num_layers)],
            file,
            file_tokens=session.token_ids[: last * bs],
            wait_for_file=partial(self.disk.wait, sid),
            hashes=[session.hashes[i] for i, _ in missing],
        )
        self.loads.track(load)
        from_host, from_disk = load.nbytes(self.layout.bytes_per_token_layer, bs)
        self.stats.bytes_host_to_gpu += from_host
        self.stats.bytes_disk_to_gpu += from_disk
        self.loader.submit(load)
        return load
