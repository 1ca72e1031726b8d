"""The session store: kept KV of multi-turn sessions across the device, host and disk tiers.

The device tier *is* the engine's block pool and prefix cache: a finished turn's full blocks
are registered by hash (`KVCacheManager.commit`), so the next turn finds them with
`match_prefix`. The store adds, per session, the kept tokens and their block hashes, an
immutable host copy per layer and a disk file, and it promotes blocks the pool has lost back
into it, layer by layer, before the request is admitted.

`SessionStore` is a thin facade over small parts, each with one job:

- `SessionCatalog` (catalog.py): the kept sessions, `info`/`snapshot`, the listeners;
- `PinBook` (pins.py): turn and prefetch pins, their TTL, releasing them under memory pressure;
- `Promoter` (promotion.py) and `LoadTracker` (loads.py): host/disk -> device, layer-wise;
- `SessionKeeper` (keeper.py): what a turn keeps, the host and disk budgets, disk writes;
- `TurnBook` (turns.py): turns in flight and their reuse counters;
- `HostTier`, `DiskTier` / `NullDiskTier`, `LayerLoader`, `TransferCosts`: the tiers, the
  loader thread and the pull-or-recompute estimates.

The parts get the objects they use at construction (no shared context). Everything here runs
on the engine thread except what is marked thread-safe.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine.sessions.catalog import SessionCatalog
from engine.sessions.costs import TransferCosts
from engine.sessions.disk_tier import make_disk_tier
from engine.sessions.eviction import make_eviction_policy
from engine.sessions.host_tier import HostTier
from engine.sessions.keeper import SessionKeeper
from engine.sessions.kvfile import KVFormatError, KVHeader, KVLayout, verify_file
from engine.sessions.loader import LayerLoader, LayerWaiter
from engine.sessions.loads import LoadTracker
from engine.sessions.pins import PinBook
from engine.sessions.promotion import Promoter
from engine.sessions.records import PrefetchResult, SessionInfo, SessionStats
from engine.sessions.turns import TurnBook

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.kv import KVCacheManager, KVCacheStorage
    from engine.scheduling import Request

_GIB = 1 << 30


def _validate(config: EngineConfig) -> None:
    for name in ("session_host_gib", "session_disk_gib", "session_prefetch_ttl_s"):
        if getattr(config, name) < 0:
            raise ValueError(f"{name} must be >= 0 (got {getattr(config, name)})")


class SessionStore:
    def __init__(
        self, config: EngineConfig, layout: KVLayout, kv: KVCacheManager, storage: KVCacheStorage, cost_model=None
    ) -> None:
        _validate(config)
        self.layout = layout
        self.block_size = config.block_size
        policy = make_eviction_policy(config.session_eviction)  # before any thread starts: may raise
        self.stats = SessionStats()
        self.disk = make_disk_tier(config.session_dir, layout, int(config.session_disk_gib * _GIB))
        self.host = HostTier(int(config.session_host_gib * _GIB), policy, whole_sessions=not self.disk.enabled)
        self.loader = LayerLoader(storage.layers, config.block_size)
        self.costs = TransferCosts(layout.bytes_per_token, cost_model, config.max_num_batched_tokens)
        self.catalog = SessionCatalog(kv.pool, self.host, self.disk, layout)
        self.listeners = self.catalog.listeners  # callables (SessionInfo) -> None, engine thread
        self.loads = LoadTracker(kv, config.block_size, self.stats)
        self.pins = PinBook(kv.pool, self.loads, config.session_prefetch_ttl_s)
        self.turns = TurnBook(config.block_size, self.stats)
        self.promoter = Promoter(kv, self.host, self.disk, layout, self.loader, self.loads, self.stats)
        self.keeper = SessionKeeper(
            kv, storage, layout, self.catalog, self.host, self.disk, self.pins, self.turns, self.stats
        )
        self.keeper.reindex()

    # -- engine hooks -------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Whether `before_step` has anything to do (one cheap check per step otherwise)."""
        return self.pins.active or self.loads.active or self.disk.has_results

    @property
    def loading(self) -> bool:
        return self.loads.loading

    def before_step(self) -> None:
        if self.disk.has_results:
            self.keeper.collect_writes()
        if self.loads.active:
            self.loads.retire_done()
        self.pins.before_step()

    def begin_turn(self, request: Request, session_id: str) -> None:
        """A request of `session_id` was added: pin (and promote) its reusable kept blocks."""
        turn = self.turns.begin(request, session_id)
        session = self.catalog.get(session_id)
        prefetched = self.pins.take_prefetch(session_id)
        if session is not None:
            n = self.promoter.common_blocks(session, request)
            turn.kept_tokens_in_prompt = n * self.block_size
            if n:
                turn.pin = self.promoter.promote(session, n)
                self.pins.hold_turn(request, turn.pin)
        if prefetched is not None:  # the turn's pin holds the blocks now
            self.pins.release(prefetched)

    def end_turn(self, request: Request, keep: bool) -> None:
        """The request finished (`keep`: store its grown KV) or was aborted. Before its blocks are freed."""
        turn = self.turns.end(request.request_id)
        if turn is None:
            return
        self.pins.drop_turn(request.request_id)
        if keep:
            self.keeper.keep(turn.session_id, request)

    def waiter(self, items) -> LayerWaiter | None:
        """The per-layer barrier for a batch whose requests use blocks still being loaded."""
        return self.loads.waiter(items)

    def retire_failed(self) -> None:
        """Drop failed loads' blocks from the prefix cache before their requests are re-admitted."""
        self.loads.retire_failed()

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        self.costs.record_prefill(num_tokens, seconds)

    def reclaim(self, num_blocks: int) -> bool:
        """Memory pressure: release pins until about `num_blocks` more blocks are free."""
        return self.pins.reclaim(num_blocks)

    # -- API for the worker service (engine thread) ---------------------------------------

    def prefetch(self, session_id: str) -> PrefetchResult:
        """Promote the session's kept blocks and pin them until a turn arrives or the TTL passes."""
        session = self.catalog.get(session_id)
        if session is None:
            return PrefetchResult(session_id, False, None, 0, 0, 0, None)
        pin = self.promoter.promote(session, len(session.hashes))
        expires_at = self.pins.hold_prefetch(pin)
        session.last_activity = time.time()
        self.stats.prefetches += 1
        self.catalog.notify(session_id)
        promoted = 0 if pin.load is None else len(pin.load.block_ids) * self.block_size
        return PrefetchResult(
            session_id,
            True,
            pin.tier,
            len(session.token_ids),
            promoted,
            len(pin.blocks) * self.block_size,
            expires_at,
        )

    def release(self, session_id: str) -> None:
        self.pins.release_prefetch(session_id)

    def adopt_file(self, path: str | Path, verified: KVHeader | None = None) -> SessionInfo:
        """Validate a downloaded KV file and index it as a local disk-tier session (the file
        is moved into the store). Corrupt or mismatched: deleted, `KVFormatError` raised.

        `verified`: the header `verify(path)` returned for this very file (called off the
        engine thread), which skips reading the whole file again here."""
        path = Path(path)
        header = verified if verified is not None else self.verify(path)
        self.keeper.adopt(header, path)
        self.stats.sessions_adopted += 1
        self.catalog.notify(header.session_id)
        return self.info(header.session_id)

    # -- thread-safe ----------------------------------------------------------------------

    def verify(self, path: str | Path) -> KVHeader:
        """Check a whole KV file against this engine's layout; a bad file is deleted and
        `KVFormatError` raised. Thread-safe (read-only besides the deletion)."""
        path = Path(path)
        try:
            return verify_file(path, self.layout)
        except KVFormatError:
            path.unlink(missing_ok=True)
            raise

    def info(self, session_id: str) -> SessionInfo | None:
        return self.catalog.info(session_id)

    def snapshot(self) -> list[SessionInfo]:
        return self.catalog.snapshot()

    def export_path(self, session_id: str) -> Path | None:
        """The session's file once any queued write of it is done; None without one."""
        return self.disk.export_path(session_id)

    def estimate_recompute_s(self, num_tokens: int) -> float:
        return self.costs.estimate_recompute_s(num_tokens)

    def estimate_pull_s(self, nbytes: int) -> float:
        return self.costs.estimate_pull_s(nbytes)

    def record_pull(self, nbytes: int, seconds: float) -> None:
        self.costs.record_pull(nbytes, seconds)

    def should_pull(self, num_tokens: int) -> bool:
        return self.costs.should_pull(num_tokens)

    def wait_loads(self, timeout: float | None = None) -> bool:
        """Wait until every promotion started so far has finished (tests, shutdown)."""
        return self.loads.wait(timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued disk writes (tests, shutdown)."""
        return self.disk.flush(timeout)

    def close(self) -> None:
        self.loader.close()
        self.disk.close()
