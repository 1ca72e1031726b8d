"""The session store: kept KV of multi-turn sessions across the device, host and disk tiers.

The device tier *is* the engine's block pool and prefix cache: a finished turn's full blocks
are registered by hash (`KVCacheManager.commit`), so the next turn finds them with
`match_prefix`. The store adds, per session, the kept tokens and their block hashes, an
immutable host copy per layer and a disk file, and it promotes blocks the pool has lost back
into it, layer by layer, before the request is admitted.

Pins. A promotion takes a reference on the session's device blocks (found or freshly loaded)
so the pool cannot reuse them before the request arrives: a *turn pin* until the request is
admitted, a *prefetch pin* until a request of the session arrives or the TTL expires. Pins
are soft: when an allocation would fail, `reclaim` releases them (prefetches first) and the
blocks fall back to ordinary LRU cache blocks. A pin whose load is still running is released
only once the load is done, so a block is never reused while the loader writes it.

Everything here runs on the engine thread except what is marked thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.kv.block_pool import Block
from engine.kv.prefix_hash import hash_block
from engine.sessions.costs import TransferCosts
from engine.sessions.disk_tier import DiskTier
from engine.sessions.eviction import make_eviction_policy
from engine.sessions.host_tier import HostTier
from engine.sessions.kvfile import KVFormatError, KVHeader, KVLayout, file_size, iter_layers, read_header, verify_file
from engine.sessions.loader import LayerLoad, LayerLoader, LayerWaiter
from engine.sessions.records import PrefetchResult, SessionInfo, SessionStats

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.kv import KVCacheManager, KVCacheStorage
    from engine.scheduling import Request

log = logging.getLogger(__name__)
_GIB = 1 << 30


def _validate(config: EngineConfig) -> None:
    for name in ("session_host_gib", "session_disk_gib", "session_prefetch_ttl_s"):
        if getattr(config, name) < 0:
            raise ValueError(f"{name} must be >= 0 (got {getattr(config, name)})")


@dataclass
class _Session:
    session_id: str
    token_ids: tuple[int, ...]  # kept tokens: whole blocks with KV
    hashes: list[bytes]  # the prefix-cache hash of each kept block
    last_activity: float  # time.time()


@dataclass
class _Pin:
    session_id: str
    blocks: list[Block]  # device blocks holding the session's first len(blocks) blocks, one ref each
    block_tiers: list[str]  # where each block came from: "gpu", "host" or "disk"
    load: LayerLoad | None = None
    expires_at: float | None = None  # time.monotonic(), prefetch pins only

    @property
    def tier(self) -> str:
        return "gpu" if self.load is None else ("disk" if self.load.from_disk else "host")


@dataclass
class _Turn:
    session_id: str
    request: Request
    pin: _Pin | None = None
    kept_tokens_in_prompt: int = 0  # the prompt's common full-block prefix with the kept tokens


@dataclass
class _LoadState:
    """Loads not yet retired, and which device block each one is still filling."""

    loads: list[LayerLoad] = field(default_factory=list)
    by_block: dict[int, LayerLoad] = field(default_factory=dict)


class SessionStore:
    def __init__(
        self, config: EngineConfig, layout: KVLayout, kv: KVCacheManager, storage: KVCacheStorage, cost_model=None
    ) -> None:
        _validate(config)
        self.layout = layout
        self.kv = kv
        self.pool = kv.pool
        self.storage = storage
        self.block_size = config.block_size
        self.ttl_s = config.session_prefetch_ttl_s
        self.disk_budget = int(config.session_disk_gib * _GIB)
        policy = make_eviction_policy(config.session_eviction)  # before any thread starts: may raise
        self.disk = DiskTier(config.session_dir, layout) if config.session_dir else None
        self.host = HostTier(int(config.session_host_gib * _GIB), policy, whole_sessions=self.disk is None)
        self.loader = LayerLoader(storage.layers, config.block_size)
        self.costs = TransferCosts(layout.bytes_per_token, cost_model, config.max_num_batched_tokens)
        self.stats = SessionStats()
        self.listeners: list[Callable[[SessionInfo], None]] = []
        self._lock = threading.RLock()  # guards _sessions for the thread-safe readers
        self._sessions: dict[str, _Session] = {}
        self._turns: dict[str, _Turn] = {}  # request id -> turn
        self._pinned_turns: dict[str, _Turn] = {}  # turns whose pin waits for admission
        self._prefetch: dict[str, _Pin] = {}  # session id -> prefetch pin
        self._deferred: list[_Pin] = []  # released pins whose load is still running
        self._busy: Counter[str] = Counter()  # session id -> turns in flight
        self._loads = _LoadState()
        if self.disk is not None:
            self._reindex()

    # -- engine hooks -------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Whether `before_step` has anything to do (one cheap check per step otherwise)."""
        return bool(
            self._pinned_turns
            or self._prefetch
            or self._deferred
            or self._loads.loads
            or (self.disk is not None and self.disk.has_results)
        )

    @property
    def loading(self) -> bool:
        return bool(self._loads.by_block)

    def before_step(self) -> None:
        if self.disk is not None and self.disk.has_results:
            self._collect_writes()
        if self._loads.loads:
            self._retire_done_loads()
        if self._deferred:
            self._release_deferred()
        if self._pinned_turns:
            self._release_admitted()
        if self._prefetch:
            self._expire_prefetches()

    def begin_turn(self, request: Request, session_id: str) -> None:
        """A request of `session_id` was added: pin (and promote) its reusable kept blocks."""
        turn = self._turns[request.request_id] = _Turn(session_id, request)
        self._busy[session_id] += 1
        session = self._sessions.get(session_id)
        prefetched = self._prefetch.pop(session_id, None)
        if session is not None:
            n = self._common_blocks(session, request)
            turn.kept_tokens_in_prompt = n * self.block_size
            if n:
                turn.pin = self._promote(session, n)
                self._pinned_turns[request.request_id] = turn
        if prefetched is not None:  # the turn's pin holds the blocks now
            self._release_pin(prefetched)

    def end_turn(self, request: Request, keep: bool) -> None:
        """The request finished (`keep`: store its grown KV) or was aborted. Before its blocks are freed."""
        turn = self._turns.pop(request.request_id, None)
        if turn is None:
            return
        self._busy[turn.session_id] -= 1
        if self._busy[turn.session_id] <= 0:
            del self._busy[turn.session_id]
        if self._pinned_turns.pop(request.request_id, None) is not None:
            self._release_pin(turn.pin)
        self._count_turn(turn)
        if keep:
            self._keep(turn.session_id, request)

    def waiter(self, items) -> LayerWaiter | None:
        """The per-layer barrier for a batch whose requests use blocks still being loaded."""
        loading, bs = self._loads.by_block, self.block_size
        found = {}
        for item in items:
            request = item.request
            ids = self.kv.table(request).ids[: -(-request.num_computed_tokens // bs)]
            loads = {id(loading[b]): loading[b] for b in ids if b in loading}
            if loads:
                found[request] = list(loads.values())
        return LayerWaiter(found) if found else None

    def retire_failed(self) -> None:
        """Drop failed loads' blocks from the prefix cache now, before their requests are
        re-admitted (a failed load sets its events a moment before it is marked done)."""
        for load in self._loads.loads:
            if load.failed:
                load.done.wait()
        self._retire_done_loads()

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        self.costs.record_prefill(num_tokens, seconds)

    def reclaim(self, num_blocks: int) -> bool:
        """Memory pressure: release pins (prefetches, then waiting turns) until about
        `num_blocks` more blocks are free. Returns whether anything was released."""
        target, released = self.pool.num_free + num_blocks, False
        for pin in self._reclaimable():
            if self.pool.num_free >= target:
                break
            if pin.load is not None:
                pin.load.done.wait()  # bounded: a load is a few copies or one file read
            self._release_pin(pin)
            released = True
        return released

    # -- API for the worker service (engine thread) ---------------------------------------

    def prefetch(self, session_id: str) -> PrefetchResult:
        session = self._sessions.get(session_id)
        if session is None:
            return PrefetchResult(session_id, False, None, 0, 0, 0, None)
        old = self._prefetch.pop(session_id, None)
        pin = self._promote(session, len(session.hashes))
        pin.expires_at = time.monotonic() + self.ttl_s
        self._prefetch[session_id] = pin
        if old is not None:
            self._release_pin(old)
        session.last_activity = time.time()
        self.stats.prefetches += 1
        self._notify(session_id)
        promoted = 0 if pin.load is None else len(pin.load.block_ids) * self.block_size
        return PrefetchResult(
            session_id,
            True,
            pin.tier,
            len(session.token_ids),
            promoted,
            len(pin.blocks) * self.block_size,
            time.time() + self.ttl_s,
        )

    def release(self, session_id: str) -> None:
        pin = self._prefetch.pop(session_id, None)
        if pin is not None:
            self._release_pin(pin)

    def adopt_file(self, path: str | Path, verified: KVHeader | None = None) -> SessionInfo:
        """Validate a downloaded KV file and index it as a local disk-tier session (the file
        is moved into the store). Corrupt or mismatched: deleted, `KVFormatError` raised.

        `verified`: the header `verify(path)` returned for this very file (called off the
        engine thread), which skips reading the whole file again here."""
        path = Path(path)
        header = verified if verified is not None else self.verify(path)
        sid = header.session_id
        self._forget_session(sid)
        now = time.time()
        if self.disk is not None:
            self.disk.install(sid, header, path, now)
        else:
            self._adopt_into_host(sid, path, now)
        self._add_session(sid, header.token_ids, now)
        self._enforce_disk_budget(0, exclude=sid)
        self.stats.sessions_adopted += 1
        self._notify(sid)
        return self.info(sid)

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
        with self._lock:
            session = self._sessions.get(session_id)
            return None if session is None else self._info(session)

    def snapshot(self) -> list[SessionInfo]:
        with self._lock:
            return [self._info(s) for s in self._sessions.values()]

    def export_path(self, session_id: str) -> Path | None:
        """The session's file once any queued write of it is done; None without one."""
        if self.disk is None:
            return None
        self.disk.wait(session_id)
        with self.disk.lock:
            entry = self.disk.entries.get(session_id)
            return entry.path if entry is not None and entry.path.exists() else None

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
        return all(load.done.wait(timeout) for load in list(self._loads.loads))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued disk writes (tests, shutdown)."""
        return True if self.disk is None else self.disk.flush(timeout)

    def close(self) -> None:
        self.loader.close()
        if self.disk is not None:
            self.disk.close()

    # -- promotion --------------------------------------------------------------------------

    def _common_blocks(self, session: _Session, request: Request) -> int:
        """Kept blocks the prompt starts with (at least one prompt token is left to compute)."""
        limit = min(len(session.hashes), (request.num_tokens - 1) // self.block_size)
        mine = self.kv.block_hashes(request, limit)
        n = 0
        while n < limit and mine[n] == session.hashes[n]:
            n += 1
        return n

    def _promote(self, session: _Session, n: int) -> _Pin:
        """Pin the session's first n blocks on the device, loading the ones the pool lost."""
        loadable = self._loadable(session.session_id)
        pin = _Pin(session.session_id, [], [])
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
        on_disk = self.disk is not None and session_id in self.disk.entries
        return on_disk or self.host.layers_held(session_id) == self.layout.num_layers

    def _start_load(self, session: _Session, missing: list[tuple[int, Block]]) -> LayerLoad:
        sid, bs = session.session_id, self.block_size
        host_layers = [self.host.layer(sid, i) for i in range(self.layout.num_layers)]
        file = self.disk.entries[sid].path if self.disk is not None and sid in self.disk.entries else None
        last = missing[-1][0] + 1
        load = LayerLoad(
            sid,
            [b.block_id for _, b in missing],
            [i for i, _ in missing],
            host_layers,
            file,
            file_tokens=session.token_ids[: last * bs],
            wait_for_file=None if file is None else (lambda: self.disk.wait(sid)),
            hashes=[session.hashes[i] for i, _ in missing],
        )
        for _, block in missing:
            self._loads.by_block[block.block_id] = load
        self._loads.loads.append(load)
        from_host, from_disk = load.nbytes(self.layout.bytes_per_token_layer, bs)
        self.stats.bytes_host_to_gpu += from_host
        self.stats.bytes_disk_to_gpu += from_disk
        self.loader.submit(load)
        return load

    def _retire_done_loads(self) -> None:
        still = []
        for load in self._loads.loads:
            if load.done.is_set():
                self._retire(load)
            else:
                still.append(load)
        self._loads.loads = still

    def _retire(self, load: LayerLoad) -> None:
        if load.retired:
            return
        load.retired = True
        by_block = self._loads.by_block
        for block_id, h in zip(load.block_ids, load.hashes):
            if by_block.get(block_id) is load:
                del by_block[block_id]
                if load.failed and self.pool.blocks[block_id].block_hash == h:
                    self.pool.unregister(self.pool.blocks[block_id])  # never serve its garbage
        if load.failed:
            self.stats.load_failures += 1

    # -- pins -------------------------------------------------------------------------------

    def _release_pin(self, pin: _Pin) -> None:
        if pin.load is not None and not pin.load.done.is_set():
            self._deferred.append(pin)
            return
        if pin.load is not None:
            self._retire(pin.load)
        self.pool.release(reversed(pin.blocks))  # tail first: the head stays cached longest
        pin.blocks = []

    def _release_deferred(self) -> None:
        pins, self._deferred = self._deferred, []
        for pin in pins:
            self._release_pin(pin)

    def _release_admitted(self) -> None:
        for rid, turn in list(self._pinned_turns.items()):
            request = turn.request
            if request.first_scheduled_time is not None or request.is_finished:
                del self._pinned_turns[rid]
                self._release_pin(turn.pin)

    def _expire_prefetches(self) -> None:
        now = time.monotonic()
        for sid, pin in list(self._prefetch.items()):
            if pin.expires_at <= now:
                del self._prefetch[sid]
                self._release_pin(pin)

    def _reclaimable(self):
        for sid in sorted(self._prefetch, key=lambda s: self._prefetch[s].expires_at):
            yield self._prefetch.pop(sid)
        for rid in reversed(list(self._pinned_turns)):  # the latest arrival is admitted last
            yield self._pinned_turns.pop(rid).pin

    # -- keeping ----------------------------------------------------------------------------

    def _count_turn(self, turn: _Turn) -> None:
        request = turn.request
        self.stats.turns += 1
        if request.first_scheduled_time is None:
            return  # never admitted: nothing reused or computed
        cached = request.num_cached_tokens
        tiers = turn.pin.block_tiers if turn.pin is not None else []
        for b in range(cached // self.block_size):
            self.stats.tokens_reused[tiers[b] if b < len(tiers) else "gpu"] += self.block_size
        self.stats.tokens_computed += max(0, request.num_prompt_tokens - cached)
        self.stats.tokens_recomputed += max(0, turn.kept_tokens_in_prompt - cached)

    def _keep(self, session_id: str, request: Request) -> None:
        n = self._keepable_blocks(request)
        if n == 0:
            return
        token_ids = tuple(request.token_ids[: n * self.block_size])
        layers = self._copy_to_host(self.kv.table(request).ids[:n])
        now = time.time()
        with self._lock:
            self._sessions[session_id] = _Session(session_id, token_ids, list(self.kv.block_hashes(request, n)), now)
            self.host.put(session_id, layers, now)
        if self.disk is not None:
            self._write_disk(session_id, token_ids, layers, now)
        self._evict_host()
        self._notify(session_id)

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

    def _write_disk(self, session_id: str, token_ids: tuple[int, ...], layers, now: float) -> None:
        size = file_size(session_id, token_ids, self.layout)
        if size > self.disk_budget:
            log.warning("session %r (%d bytes) exceeds the disk budget; kept without a disk copy", session_id, size)
            self.disk.delete(session_id)
            return
        self._enforce_disk_budget(size, exclude=session_id)
        self.disk.write(session_id, token_ids, layers, size, now)

    def _evict_host(self) -> None:
        evicted = self.host.evict_to_budget(lambda sid: sid in self._busy or sid in self._prefetch)
        self.stats.host_layer_evictions += len(evicted)
        for sid in dict.fromkeys(sid for sid, _ in evicted):
            if self.disk is None or sid not in self.disk.entries:
                self.host.drop(sid)  # a partial copy with nothing to complete it is useless
            self._notify(sid)

    def _enforce_disk_budget(self, incoming: int, exclude: str | None) -> None:
        """Drop least recently active idle sessions until `incoming` more bytes fit."""
        if self.disk is None:
            return
        total = self.disk.nbytes - (self.disk.entries[exclude].nbytes if exclude in self.disk.entries else 0)
        for sid in sorted(self.disk.entries, key=lambda s: self.disk.entries[s].last_activity):
            if total + incoming <= self.disk_budget:
                return
            if sid == exclude or sid in self._busy or sid in self._prefetch:
                continue
            total -= self.disk.entries[sid].nbytes
            self._drop_session(sid)

    def _drop_session(self, session_id: str) -> None:
        self._forget_session(session_id)
        self.stats.sessions_dropped += 1
        self._notify(session_id)

    def _forget_session(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)
            self.host.drop(session_id)
        self.release(session_id)
        if self.disk is not None and session_id in self.disk.entries:
            self.disk.delete(session_id)

    def _collect_writes(self) -> None:
        for result in self.disk.take_results():
            self.stats.bytes_written_disk += result.nbytes
            if result.error is not None:
                self.stats.disk_write_failures += 1
                self.disk.entries.pop(result.session_id, None)
                self._notify(result.session_id)

    # -- indexing ---------------------------------------------------------------------------

    def _add_session(self, session_id: str, token_ids, last_activity: float) -> None:
        hashes, parent, bs = [], None, self.block_size
        for i in range(len(token_ids) // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        with self._lock:
            self._sessions[session_id] = _Session(session_id, tuple(token_ids), hashes, last_activity)

    def _reindex(self) -> None:
        for header, entry in self.disk.reindex():
            self._add_session(header.session_id, header.token_ids, entry.last_activity)
        if self._sessions:
            log.info("session store: %d sessions re-indexed from %s", len(self._sessions), self.disk.dir)
        self._enforce_disk_budget(0, exclude=None)

    def _adopt_into_host(self, session_id: str, path: Path, now: float) -> None:
        with open(path, "rb") as f:
            layers = list(iter_layers(f, read_header(f, self.layout)))
        path.unlink(missing_ok=True)
        self.host.put(session_id, layers, now)
        self._evict_host()

    # -- reporting --------------------------------------------------------------------------

    def _info(self, session: _Session) -> SessionInfo:
        sid = session.session_id
        tiers = []
        if session.hashes and all(self.pool.lookup(h) is not None for h in session.hashes):
            tiers.append("gpu")
        if self.host.layers_held(sid) == self.layout.num_layers:
            tiers.append("host")
        if self.disk is not None and sid in self.disk.entries:
            tiers.append("disk")
        n = len(session.token_ids)
        return SessionInfo(sid, n, tuple(tiers), n * self.layout.bytes_per_token, session.last_activity)

    def _notify(self, session_id: str) -> None:
        if not self.listeners:
            return
        info = self.info(session_id) or SessionInfo(session_id, 0, (), 0, time.time())
        for listener in self.listeners:
            try:
                listener(info)
            except Exception:  # a listener's bug must not take the engine down
                log.exception("session listener failed")
