"""The advisory service (`tandem advisory`): typing hints in, placements and prefetches out.

Inputs: `advisory` (hints, consumer group `tandem-advisory`), `sessions.directory` (read from the
start: the directory is rebuilt after a restart), `sessions.placement` (read back once at start,
so live placements keep counting as pending load), heartbeats and telemetry (live workers, load),
and the request topics (a session's request arriving ends its advised turn's pending load).
Outputs: `SessionPlacement` on `sessions.placement` (the scheduler routes the turn by it),
`Prefetch` on `control` (the target promotes or pulls the KV), and tombstones for placements
whose turn did not come within their TTL. The target releases its prefetch pin on its own after
`Prefetch.ttl_s` (no release message: a lost message could otherwise pin KV forever).

Two advisory services may run at once: one active, one standby (`services/standby.py`). The
standby waits; taking over is the restart above (directory and live placements rebuilt from
their compacted topics), and hints are read from the group's committed offsets. Placements carry
the lease term (the scheduler drops one of an older term than it has seen), and the active
publishes only while its lease holds.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka import ConsumerRecord

from services.advisory.advisor import Advice, Advisor, AdvisorLimits
from services.advisory.settings import AdvisorySettings
from services.advisory.targets import make_target_policy
from services.standby import ActiveStandby
from shared.broker_watch import BrokerRestart, BrokerWatch
from shared.fence_feed import follow_fences
from shared.kafka import KafkaClient, fetch_decoded, read_to_end, tail
from shared.live_workers import LiveWorkers
from shared.metrics import ServiceMetrics
from shared.records import decode_record, record_key
from shared.schemas.control import ControlEnvelope
from shared.schemas.requests import GenerateRequest
from shared.schemas.sessions import SessionLocation, SessionPlacement, TypingHint
from shared.schemas.telemetry import Heartbeat, Telemetry
from shared.topics import Topics

log = logging.getLogger(__name__)
_EXPIRY_INTERVAL_S = 0.5


class AdvisoryService:
    def __init__(self, settings: AdvisorySettings) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.kafka = KafkaClient(settings, settings.advisory_id)
        limits = AdvisorLimits(
            settings.placement_ttl_s,
            settings.max_placement_ttl_s,
            settings.hint_max_age_s,
            settings.default_arrival_s,
            settings.turn_grace_s,
        )
        self.advisor = Advisor(make_target_policy(settings.target_policy, settings.kv_high_water), limits)
        self.workers = LiveWorkers(settings.worker_timeout_s)
        self._tasks: list[asyncio.Task] = []
        self.broker_watch = BrokerWatch(
            self.kafka, settings.topic_prefix, self._on_broker_restart, interval_s=settings.broker_watch_interval_s
        )
        self.lease = ActiveStandby(
            self.kafka, self.topics.leases.name, "advisory", settings.advisory_id, settings.lease_s
        )
        self._init_metrics()

    async def _on_broker_restart(self, restart: BrokerRestart) -> None:
        """The advisory keeps its placements in memory: beyond the repair, only the lease's terms
        start again on the new broker (services/standby.py)."""
        self.lease.broker_restarted()

    def _init_metrics(self) -> None:
        m = self.metrics = ServiceMetrics("advisory")
        self.m_hints = m.counter("advisory_hints_total", "hints by outcome", ("outcome",))
        self.m_placements = m.gauge("advisory_live_placements", "placements not yet expired")
        self.m_sessions = m.gauge("advisory_directory_sessions", "sessions with a known KV copy")

    # -- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        await self.kafka.start(self.topics.static())
        self.metrics.serve(self.settings.metrics_port)
        # The live-worker view (load, fences) is kept from the start, standby too: a standby
        # that takes over places its first hints on current loads, not on holders alone.
        heartbeats, telemetry = [await self._from_end(t.name) for t in (self.topics.heartbeats, self.topics.telemetry)]
        self._tasks = [
            asyncio.create_task(c)
            for c in (
                self._heartbeat_loop(heartbeats),
                self._telemetry_loop(telemetry),
                follow_fences(self.kafka, self.topics.scheduler_fences.name, self.workers),
            )
        ]
        await self.broker_watch.start()  # standby too: any instance may repair the topics
        await self.lease.start(self._activate)

    async def _activate(self, term: int) -> None:
        """Holding the lease: rebuild the directory and placements, then read hints."""
        await self._restore_placements()
        directory = await self._from_start(self.topics.sessions_directory.name)
        await read_to_end(directory, self._on_location)
        log.info(
            "directory rebuilt: %d sessions, %d live placements", len(self.advisor.directory), len(self.advisor.pending)
        )
        requests = [await self._from_end(t.name) for t in (self.topics.rt_requests, self.topics.be_requests)]
        # Assigned, not subscribed (the lease makes this the only reader): no group join to wait for.
        hints = await self.kafka.owned_consumer(self.topics.advisory.name, group="tandem-advisory", hot=True)
        await self._await_loads()
        loops = (
            self._directory_loop(directory),
            self._request_loop(requests[0]),
            self._request_loop(requests[1]),
            self._hint_loop(hints),
            self._expiry_loop(),
        )
        self._tasks += [asyncio.create_task(c) for c in loops]

    async def _await_loads(self) -> None:
        """Until every heartbeating worker has reported its load (at most `worker_timeout_s`): a
        hint decided before that sees every worker idle and goes to the session's holder.
        Bounded, since a worker that never sends telemetry must not stop all placements."""
        deadline = time.monotonic() + self.settings.worker_timeout_s
        while time.monotonic() < deadline:
            live = self.workers.live()
            if live and all(w.telemetry is not None for w in live.values()):
                return
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        await self.broker_watch.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.lease.stop()
        await self.kafka.stop()

    async def _from_start(self, topic: str):
        c = await self.kafka.consumer(group=None)
        await self.kafka.assign_all(c, topic, from_end=False)
        return c

    async def _from_end(self, topic: str):
        c = await self.kafka.consumer(group=None)
        await self.kafka.assign_all(c, topic, from_end=True)
        return c

    async def _restore_placements(self) -> None:
        consumer = await self._from_start(self.topics.sessions_placement.name)
        now = time.time()

        def apply(m: ConsumerRecord) -> None:
            session_id = record_key(m)
            placement = decode_record(SessionPlacement, m, tombstone_ok=True)
            if session_id is not None and (placement is not None or m.value is None):
                self.advisor.restore_placement(session_id, placement, now)

        await read_to_end(consumer, apply)
        await consumer.stop()

    # -- input loops ---------------------------------------------------------------------

    def _on_location(self, m: ConsumerRecord) -> None:
        location = decode_record(SessionLocation, m, tombstone_ok=True)
        if location is not None:
            self.advisor.on_location(location)
        self.m_sessions.set(len(self.advisor.directory))

    async def _directory_loop(self, consumer) -> None:
        await tail(consumer, self._on_location)

    async def _heartbeat_loop(self, consumer) -> None:
        while True:
            for hb in await fetch_decoded(consumer, Heartbeat):
                self.workers.on_heartbeat(hb)

    async def _telemetry_loop(self, consumer) -> None:
        while True:
            for t in await fetch_decoded(consumer, Telemetry):
                self.workers.on_telemetry(t)

    async def _request_loop(self, consumer) -> None:
        while True:
            for req in await fetch_decoded(consumer, GenerateRequest):
                self.advisor.on_turn(req.session_id)

    async def _hint_loop(self, consumer) -> None:
        while True:
            hints = await fetch_decoded(consumer, TypingHint, timeout_ms=100)
            for hint in hints:
                try:
                    await self._on_hint(hint)
                except Exception:  # noqa: BLE001 (the broker is away: this hint is lost, the turn still runs)
                    log.warning("hint for session %s not handled", hint.session_id, exc_info=True)
            if hints:
                try:
                    await consumer.commit()
                except Exception:  # noqa: BLE001 (a rebalance: the next batch commits)
                    log.warning("hint offsets not committed", exc_info=True)

    async def _on_hint(self, hint: TypingHint) -> None:
        if not self.lease.is_active():
            return  # deposed or lapsed: the hint is only advice, the turn still runs
        advice = self.advisor.on_hint(hint, self.workers.live())
        if isinstance(advice, str):
            self.m_hints.labels(advice).inc()
            log.debug("hint for session %s: %s", hint.session_id, advice)
            return
        await self._publish(advice)
        self.m_hints.labels("refreshed" if advice.refreshed else "placed").inc()
        log.info(
            "session %s -> %s (%s)",
            hint.session_id,
            advice.placement.worker_id,
            f"pull from {advice.prefetch.source_worker}" if advice.prefetch.source_worker else "local",
        )

    async def _publish(self, advice: Advice) -> None:
        # The prefetch first: the transfer starts while the placement travels to the scheduler.
        sid = advice.placement.session_id
        placement = advice.placement.model_copy(update={"term": self.lease.term})
        prefetch = advice.prefetch.model_copy(update={"term": self.lease.term})
        await self.kafka.send(self.topics.control.name, ControlEnvelope(message=prefetch), key=sid)
        await self.kafka.send(self.topics.sessions_placement.name, placement, key=sid)

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(_EXPIRY_INTERVAL_S)
            if not self.lease.is_active():
                continue
            for sid in self.advisor.expire():
                try:
                    await self.kafka.send(self.topics.sessions_placement.name, None, key=sid)
                except Exception:  # noqa: BLE001 (the scheduler ignores expired placements anyway)
                    log.warning("placement tombstone not sent", exc_info=True)
            self.m_placements.set(len(self.advisor.placements))
