"""Promotions in flight: which device blocks a `LayerLoad` is still filling, until it is retired.

The engine asks two things of running loads each step: which requests of a batch read blocks
still being filled (they get a per-layer barrier, `LayerWaiter`), and which loads have
finished, so they stop costing that check. A failed load's blocks are removed from the
prefix cache when it is retired, before anyone can match them again; the engine then
recomputes the requests that used them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sessions.loader import LayerLoad, LayerWaiter
from engine.sessions.records import SessionStats

if TYPE_CHECKING:
    from engine.kv import KVCacheManager


class LoadTracker:
    """Engine thread only (the loader thread only sets a load's events)."""

    def __init__(self, kv: KVCacheManager, block_size: int, stats: SessionStats) -> None:
        self.kv = kv
        self.pool = kv.pool
        self.block_size = block_size
        self.stats = stats
        self._loads: list[LayerLoad] = []  # not yet retired
        self._by_block: dict[int, LayerLoad] = {}  # device block id -> the load still filling it

    @property
    def active(self) -> bool:
        """Whether any load is not yet retired."""
        return bool(self._loads)

    @property
    def loading(self) -> bool:
        """Whether any device block is still being filled (the step then needs a `waiter`)."""
        return bool(self._by_block)

    def track(self, load: LayerLoad) -> None:
        for block_id in load.block_ids:
            self._by_block[block_id] = load
        self._loads.append(load)

    def waiter(self, items) -> LayerWaiter | None:
        """The per-layer barrier for a batch whose requests use blocks still being loaded."""
        loading, bs = self._by_block, self.block_size
        found = {}
        for item in items:
            request = item.request
            ids = self.kv.table(request).ids[: -(-request.num_computed_tokens // bs)]
            loads = {id(loading[b]): loading[b] for b in ids if b in loading}
            if loads:
                found[request] = list(loads.values())
        return LayerWaiter(found) if found else None

    def retire_done(self) -> None:
        still = []
        for load in self._loads:
            if load.done.is_set():
                self.retire(load)
            else:
                still.append(load)
        self._loads = still

    def retire_failed(self) -> None:
        """Drop failed loads' blocks from the prefix cache now, before their requests are
        re-admitted (a failed load sets its events a moment before it is marked done)."""
        for load in self._loads:
            if load.failed:
                load.done.wait()
        self.retire_done()

    def retire(self, load: LayerLoad) -> None:
        """Stop tracking a finished load; a failed one's blocks leave the prefix cache."""
        if load.retired:
            return
        load.retired = True
        for block_id, h in zip(load.block_ids, load.hashes):
            if self._by_block.get(block_id) is load:
                del self._by_block[block_id]
                if load.failed and self.pool.blocks[block_id].block_hash == h:
                    self.pool.unregister(self.pool.blocks[block_id])  # never serve its garbage
        if load.failed:
            self.stats.load_failures += 1

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every load started so far has finished (tests, shutdown)."""
        return all(load.done.wait(timeout) for load in list(self._loads))
