"""`AsyncLLM.sessions`: the session store's operations for services, each run where it is safe.

Whatever changes or walks the store's state (prefetch, release, adopting a pulled file, its
info, the pull-or-recompute decision and the bandwidth it learns from) runs on the engine
thread, between steps. Two calls wait on files and run in a helper thread instead, through
methods the store documents as thread-safe: `verify` reads a whole pulled file (tens of MB) and
`export_path` waits for the disk writer to finish a queued write of the session; on the engine
thread either would stall every stream for as long. Listeners the store notifies on the engine
thread are called on the subscriber's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from engine.sessions import PrefetchResult, SessionInfo, SessionStore

Caller = Callable[..., Awaitable[Any]]  # AsyncLLM.call: fn(engine, *args) on the engine thread


class SessionDoor:
    def __init__(self, call: Caller, store: Callable[[], SessionStore]) -> None:
        self._call = call
        self._store = store  # the engine's store, for its thread-safe methods only

    async def subscribe(self, listener: Callable[[SessionInfo], None]) -> int:
        """Call `listener(info)` on this event loop for every kept session now (sessions
        re-indexed from disk at start-up included) and for every change from now on, in the
        order the store saw them. Returns how many sessions are kept now."""
        loop = asyncio.get_running_loop()
        return await self._call(_subscribe, lambda info: loop.call_soon_threadsafe(listener, info))

    async def info(self, session_id: str) -> SessionInfo | None:
        return await self._call(_info, session_id)

    async def prefetch(self, session_id: str) -> PrefetchResult:
        """Promote the session's KV towards the device and pin it until a turn of the session
        arrives or the engine's prefetch TTL expires."""
        return await self._call(_prefetch, session_id)

    async def release(self, session_id: str) -> None:
        """Drop the session's prefetch pin (its blocks stay cached)."""
        await self._call(_release, session_id)

    async def adopt_file(self, path: Path) -> SessionInfo:
        """Check a pulled KV file in full (helper thread), then index it as a kept session
        (engine thread). A bad file is deleted and `KVFormatError` raised."""
        header = await asyncio.to_thread(self._store().verify, path)
        return await self._call(_adopt, path, header)

    async def export_path(self, session_id: str) -> Path | None:
        """The session's KV file for a peer, once any queued write of it is done; None without one."""
        return await asyncio.to_thread(self._store().export_path, session_id)

    async def should_pull(self, missing_tokens: int) -> bool:
        """Whether pulling the KV of `missing_tokens` beats recomputing them (the store's cost model)."""
        return await self._call(_should_pull, missing_tokens)

    async def record_pull(self, nbytes: int, seconds: float) -> None:
        """A measured transfer, for the pull bandwidth `should_pull` uses."""
        await self._call(_record_pull, nbytes, seconds)


# The engine-thread halves (module functions: `AsyncLLM.call` passes the engine first).


def _subscribe(engine, notify: Callable[[SessionInfo], None]) -> int:
    engine.sessions.listeners.append(notify)
    kept = engine.sessions.snapshot()
    for info in kept:  # through the listener, so nothing sent later can overtake it
        notify(info)
    return len(kept)


def _info(engine, session_id: str) -> SessionInfo | None:
    return engine.sessions.info(session_id)


def _prefetch(engine, session_id: str) -> PrefetchResult:
    return engine.sessions.prefetch(session_id)


def _release(engine, session_id: str) -> None:
    engine.sessions.release(session_id)


def _adopt(engine, path: Path, header) -> SessionInfo:
    return engine.sessions.adopt_file(path, verified=header)


def _should_pull(engine, missing_tokens: int) -> bool:
    return engine.sessions.should_pull(missing_tokens)


def _record_pull(engine, nbytes: int, seconds: float) -> None:
    engine.sessions.record_pull(nbytes, seconds)
