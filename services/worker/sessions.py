"""The worker's side of multi-turn sessions (docs/sessions.md, "Services").

- Serves its kept KV to peers (`KVServer`) and advertises the URL in heartbeats and locations.
- Publishes a `SessionLocation` on `sessions.directory` whenever the engine's session store
  reports a change (kept or grown after a turn, promoted, adopted, dropped), and one for every
  session it re-indexed from disk at start-up.
- `Prefetch` (from the advisory service): pull the KV from the holder if this worker's copy is
  missing or older, then promote it towards the device and pin it; the pin is released after
  min(`Prefetch.ttl_s`, the engine's `session_prefetch_ttl_s`) unless the turn came first.
- A turn carrying `kv_source` (the scheduler sent it to a non-holder): wait for a pull already
  under way for the session (started by a prefetch), else pull if the engine's cost model says
  the transfer beats recomputing the missing tokens, else recompute.
A refused transfer (corrupt, truncated, other model) leaves no file behind and the turn
recomputes: the output is the same, only slower.

Every store operation goes through `AsyncLLM.sessions` (engine/session_door.py), which runs it
on the engine thread or, for the file waits the store allows elsewhere, a helper thread.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from pathlib import Path

from engine.async_llm import AsyncLLM
from engine.sessions import KVFormatError, SessionInfo
from engine.snapshot import EngineSnapshot
from services.worker.kv_auth import PeerVerifier
from services.worker.kv_pull import KVPuller, PullError
from services.worker.kv_server import KVServer
from services.worker.settings import WorkerSettings
from shared.aio import run_on_event
from shared.kafka import KafkaClient
from shared.schemas.requests import GenerateRequest
from shared.schemas.sessions import Prefetch, SessionLocation

log = logging.getLogger(__name__)
_LOOPBACK = ("127.0.0.1", "localhost", "::1")  # a KV server bound here needs no secret
_GIB = 1 << 30
_MIN_BANDWIDTH_SAMPLE = 1 << 20


class WorkerSessions:
    def __init__(
        self,
        llm: AsyncLLM,
        kafka: KafkaClient,
        directory_topic: str,
        worker_id: str,
        settings: WorkerSettings,
        session_dir: Path,
    ) -> None:
        self.llm, self.kafka, self.topic, self.worker_id = llm, kafka, directory_topic, worker_id
        self.settings = settings
        secret = settings.cluster_secret.get_secret_value()
        verifier = PeerVerifier(secret) if secret else None
        self.server = KVServer(settings.kv_host, settings.kv_port, llm.sessions.export_path, verifier)
        self.puller = KVPuller(
            session_dir / ".incoming", settings.kv_pull_timeout_s, int(settings.session_disk_gib * _GIB), secret
        )
        self.counters: Counter[str] = Counter()
        self._pulls: dict[str, asyncio.Task] = {}  # session id -> its pull under way
        self._prefetch_hint: dict[str, str] = {}  # session id -> the hint whose pin is held
        self.advisory_term = 0  # the highest advisory lease term on a prefetch read (older: dropped)
        self._dirty: dict[str, SessionInfo] = {}
        self._dirty_event = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.kv_url: str | None = None

    async def start(self) -> None:
        await self.server.start()
        if not self.settings.cluster_secret.get_secret_value() and self.settings.kv_host not in _LOOPBACK:
            log.warning(
                "the KV server listens on %s without TANDEM_CLUSTER_SECRET: anyone who reaches it can "
                "read session KV caches",
                self.settings.kv_host,
            )
        host = self.settings.kv_host if self.settings.kv_host not in ("0.0.0.0", "::") else socket.gethostname()
        self.kv_url = self.settings.kv_advertise_url or f"http://{host}:{self.server.port}"
        kept = await self.llm.sessions.subscribe(self._mark)  # re-indexed from disk too: tell the directory
        self._spawn(self._publish_loop())
        log.info("KV server on %s (%d sessions kept)", self.kv_url, kept)

    async def stop(self) -> None:
        await self._flush_locations()
        for t in list(self._tasks) + list(self._pulls.values()):
            t.cancel()
        await asyncio.gather(*self._tasks, *self._pulls.values(), return_exceptions=True)
        await self.server.stop()
        await self.puller.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the directory -----------------------------------------------------------------------

    def _mark(self, info: SessionInfo) -> None:
        self._dirty[info.session_id] = info  # the latest state per session is what counts
        self._dirty_event.set()

    async def _publish_loop(self) -> None:
        failed = "session locations not published"
        await run_on_event(self._dirty_event, self._flush_locations, failed=failed, logger=log)

    async def _flush_locations(self) -> None:
        batch, self._dirty = self._dirty, {}
        try:
            acks = [await self.kafka.send_nowait(self.topic, self._location(i), key=sid) for sid, i in batch.items()]
            await asyncio.gather(*acks)
        except Exception:  # noqa: BLE001 (the broker is away: the next change republishes)
            log.warning("session locations not published", exc_info=True)

    def _location(self, info: SessionInfo) -> SessionLocation:
        return SessionLocation(
            session_id=info.session_id,
            worker_id=self.worker_id,
            kv_url=self.kv_url,
            tiers=list(info.tiers),
            num_tokens=info.num_tokens,
            nbytes=info.nbytes,
            last_activity=info.last_activity,
            dropped=not info.tiers,
        )

    # -- turns and prefetches ------------------------------------------------------------------

    def must_prepare(self, req: GenerateRequest) -> bool:
        """Whether a turn has to wait before it enters the engine: a pull of its session is under
        way here, or it carries a `kv_source` to consider pulling from."""
        return req.session_id in self._pulls or req.kv_source is not None

    async def prepare(self, req: GenerateRequest, num_prompt_tokens: int) -> None:
        """Before a session turn enters the engine: get its KV here if that beats recomputing.
        Never fails the turn: whatever goes wrong, the engine recomputes what is missing."""
        try:
            await self._prepare(req, num_prompt_tokens)
        except Exception:  # noqa: BLE001
            log.exception("getting the KV of session %s failed; recomputing", req.session_id)

    async def _prepare(self, req: GenerateRequest, num_prompt_tokens: int) -> None:
        sid = req.session_id
        under_way = self._pulls.get(sid)
        if under_way is not None:
            await asyncio.wait({under_way}, timeout=self.settings.kv_pull_timeout_s)
            return
        src = req.kv_source
        if src is None:
            return
        have = await self._local_tokens(sid)
        missing = min(src.num_tokens or num_prompt_tokens, num_prompt_tokens) - have
        if missing <= 0:
            return
        if not await self._should_pull(missing):
            self.counters["pulls_skipped_for_recompute"] += 1
            return
        await self._pull(sid, src.url)

    async def _should_pull(self, missing_tokens: int) -> bool:
        mode = self.settings.session_pull
        return mode == "always" or (mode == "cost" and await self.llm.sessions.should_pull(missing_tokens))

    def on_prefetch(self, msg: Prefetch) -> None:
        """A prefetch read on `control` (any worker's: each one read advances the advisory term
        this worker knows). One of an older term than that comes from a deposed advisory service
        and is dropped, like its placements at the scheduler; this worker's own are acted on."""
        if msg.term < self.advisory_term:
            self.counters["prefetches_stale_term"] += 1
            log.info(
                "prefetch of session %s dropped: advisory term %d < %d", msg.session_id, msg.term, self.advisory_term
            )
            return
        self.advisory_term = msg.term
        if msg.worker_id == self.worker_id:
            self._spawn(self._prefetch_logged(msg))

    async def _prefetch_logged(self, msg: Prefetch) -> None:
        try:
            await self._prefetch(msg)
        except Exception:  # noqa: BLE001 (a failed prefetch only costs the turn a recompute)
            log.exception("prefetch of session %s failed", msg.session_id)

    async def _prefetch(self, msg: Prefetch) -> None:
        sid = msg.session_id
        if msg.source_url and await self._local_tokens(sid) < msg.source_tokens:
            if not await self._pull(sid, msg.source_url):
                return  # the turn will recompute (or pull again, from its kv_source)
        result = await self.llm.sessions.prefetch(sid)
        if not result.found:
            log.info("prefetch of unknown session %s ignored", sid)
            return
        self.counters["prefetches"] += 1
        self._prefetch_hint[sid] = msg.hint_id
        if msg.ttl_s < self.settings.session_prefetch_ttl_s:  # else the engine's own TTL ends the pin
            asyncio.get_running_loop().call_later(msg.ttl_s, self._release_if_current, sid, msg.hint_id)
        log.info("prefetched session %s from %s (%d tokens)", sid, result.tier, result.num_tokens)

    def _release_if_current(self, session_id: str, hint_id: str) -> None:
        if self._prefetch_hint.get(session_id) == hint_id:  # a newer hint keeps its own pin
            del self._prefetch_hint[session_id]
            self._spawn(self.llm.sessions.release(session_id))

    async def _local_tokens(self, session_id: str) -> int:
        info = await self.llm.sessions.info(session_id)
        return info.num_tokens if info is not None and info.tiers else 0

    async def _pull(self, session_id: str, url: str) -> bool:
        """Pull (or join the pull under way); True when the session's KV is now kept here."""
        task = self._pulls.get(session_id)
        if task is None:
            task = self._pulls[session_id] = asyncio.create_task(self._pull_once(session_id, url))
            task.add_done_callback(
                lambda t: self._pulls.pop(session_id, None) if self._pulls.get(session_id) is t else None
            )
        return await asyncio.shield(task)

    async def _pull_once(self, session_id: str, url: str) -> bool:
        try:
            pulled = await self.puller.fetch(url)
        except PullError as exc:
            self.counters["pulls_failed"] += 1
            log.warning("pull of session %s failed: %r", session_id, exc)
            return False
        try:  # the full check reads the whole file in a helper thread: the engine keeps stepping
            info = await self.llm.sessions.adopt_file(pulled.path)
        except (KVFormatError, OSError) as exc:
            self.counters["pulls_refused"] += 1
            log.warning("pulled KV of session %s refused: %r", session_id, exc)
            return False
        finally:
            pulled.path.unlink(missing_ok=True)  # adopted files were moved away already
        if pulled.nbytes >= _MIN_BANDWIDTH_SAMPLE:  # smaller transfers measure latency, not bandwidth
            await self.llm.sessions.record_pull(pulled.nbytes, pulled.seconds)
        self.counters["pulls"] += 1
        self.counters["bytes_pulled"] += pulled.nbytes
        log.info(
            "pulled session %s: %d tokens, %d bytes in %.3fs",
            info.session_id,
            info.num_tokens,
            pulled.nbytes,
            pulled.seconds,
        )
        return info.session_id == session_id

    # -- reporting ---------------------------------------------------------------------------

    def stats(self, snapshot: EngineSnapshot) -> dict[str, float]:
        """The engine's session counters (as of `snapshot`) plus this service's, flat (heartbeats,
        `/v1/sessions/stats`)."""
        out: dict[str, float] = dict(snapshot.session_stats)
        out.update(self.counters)
        out["served_bytes"] = self.server.bytes_served  # not "bytes_*": the puller counts them already
        out["served_sessions"] = self.server.sessions_served
        return out
