"""Pins: references that keep a session's device blocks until a request of it can use them.

A *turn pin* holds a turn's reused blocks from `add_request` until the scheduler admits the
request (the request then holds its own references). A *prefetch pin* holds a hinted
session's blocks until a turn of it arrives (the turn's pin takes over) or the TTL passes.

Pins are soft. When an allocation would fail, `reclaim` releases them, prefetches first
(earliest expiry first), then waiting turns (latest arrival first, since it is admitted
last), and their blocks become ordinary LRU cache blocks: prefetched KV takes free memory
greedily but never costs a running request its KV. A pin whose load is still running is
released only after the load has finished, so a block is never reused while the loader
writes into it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv.block_pool import Block, BlockPool
from engine.sessions.loader import LayerLoad
from engine.sessions.loads import LoadTracker

if TYPE_CHECKING:
    from engine.scheduling import Request


@dataclass
class Pin:
    session_id: str
    blocks: list[Block]  # device blocks holding the session's first len(blocks) blocks, one ref each
    block_tiers: list[str]  # where each block came from: "gpu", "host" or "disk"
    load: LayerLoad | None = None  # the promotion filling the blocks the pool had lost
    expires_at: float | None = None  # time.monotonic(), prefetch pins only

    @property
    def tier(self) -> str:
        """The slowest tier the pinned blocks came from."""
        return "gpu" if self.load is None else ("disk" if self.load.from_disk else "host")


class PinBook:
    """The live pins. Engine thread only."""

    def __init__(self, pool: BlockPool, loads: LoadTracker, ttl_s: float) -> None:
        self.pool = pool
        self.loads = loads
        self.ttl_s = ttl_s
        self._turns: dict[str, tuple[Request, Pin]] = {}  # request id -> a turn pin waiting for admission
        self._prefetches: dict[str, Pin] = {}  # session id -> prefetch pin
        self._deferred: list[Pin] = []  # released pins whose load is still running

    @property
    def active(self) -> bool:
        """Whether `before_step` has anything to do."""
        return bool(self._turns or self._prefetches or self._deferred)

    def held_blocks(self) -> list[Block]:
        """Every device block a live pin references, once per pin holding it (for the KV
        manager's reference-count check)."""
        pins = [pin for _, pin in self._turns.values()] + list(self._prefetches.values()) + self._deferred
        return [block for pin in pins for block in pin.blocks]

    def before_step(self) -> None:
        """Release what is due: pins whose load has finished, admitted turns, expired prefetches."""
        if self._deferred:
            pins, self._deferred = self._deferred, []
            for pin in pins:
                self.release(pin)
        if self._turns:
            self._release_admitted()
        if self._prefetches:
            self._expire_prefetches()

    # -- turn pins ----------------------------------------------------------------------

    def hold_turn(self, request: Request, pin: Pin) -> None:
        self._turns[request.request_id] = (request, pin)

    def drop_turn(self, request_id: str) -> None:
        """The turn ended (finished or aborted) before its pin was released."""
        held = self._turns.pop(request_id, None)
        if held is not None:
            self.release(held[1])

    def _release_admitted(self) -> None:
        for rid, (request, pin) in list(self._turns.items()):
            if request.first_scheduled_time is not None or request.is_finished:
                del self._turns[rid]
                self.release(pin)

    # -- prefetch pins ------------------------------------------------------------------

    def hold_prefetch(self, pin: Pin) -> float:
        """Pin until a turn arrives or the TTL passes (replacing an older prefetch of the
        session, released after the new pin holds the blocks). Returns the wall-clock expiry."""
        pin.expires_at = time.monotonic() + self.ttl_s
        old = self._prefetches.pop(pin.session_id, None)
        self._prefetches[pin.session_id] = pin
        if old is not None:
            self.release(old)
        return time.time() + self.ttl_s

    def take_prefetch(self, session_id: str) -> Pin | None:
        """Stop tracking the session's prefetch pin; the caller releases it."""
        return self._prefetches.pop(session_id, None)

    def release_prefetch(self, session_id: str) -> None:
        pin = self._prefetches.pop(session_id, None)
        if pin is not None:
            self.release(pin)

    def has_prefetch(self, session_id: str) -> bool:
        return session_id in self._prefetches

    def _expire_prefetches(self) -> None:
        now = time.monotonic()
        for sid, pin in list(self._prefetches.items()):
            if pin.expires_at <= now:
                del self._prefetches[sid]
                self.release(pin)

    # -- releasing ----------------------------------------------------------------------

    def release(self, pin: Pin) -> None:
        """Drop the pin's references now, or once its load has finished."""
        if pin.load is not None and not pin.load.done.is_set():
            self._deferred.append(pin)
            return
        if pin.load is not None:
            self.loads.retire(pin.load)  # a failed load's blocks leave the prefix cache first
        self.pool.release(reversed(pin.blocks))  # tail first: the head stays cached longest
        pin.blocks = []

    def reclaim(self, num_blocks: int) -> bool:
        """Memory pressure: release pins (prefetches, then waiting turns) until about
        `num_blocks` more blocks are free. Returns whether anything was released."""
        target, released = self.pool.num_free + num_blocks, False
        for pin in self._reclaimable():
            if self.pool.num_free >= target:
                break
            if pin.load is not None:
                pin.load.done.wait()  # bounded: a load is a few copies or one file read
            self.release(pin)
            released = True
        return released

    def _reclaimable(self) -> Iterator[Pin]:
        for sid in sorted(self._prefetches, key=lambda s: self._prefetches[s].expires_at):
            yield self._prefetches.pop(sid)
        for rid in reversed(list(self._turns)):  # the latest arrival is admitted last
            yield self._turns.pop(rid)[1]
