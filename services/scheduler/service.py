"""The scheduler service: places RT and BE requests on workers.

Requests are read from `requests.rt` / `requests.be` in one consumer group and committed only
once placed (`OffsetTracker`), so nothing is lost if the scheduler dies; the assignment table
(persisted in `scheduler.state`) makes a redelivered request a no-op. Requests with no worker to
go to (no worker yet, or BE without RT headroom) wait in memory, RT first. When a worker stops
heartbeating, or a request it was given is neither running nor finished there after a grace
period, the owning gateway is told (`Rerouted`) and re-submits it with the tokens its client has
already received: the stream resumes on another worker. A lost worker's epoch is fenced
(`Fence` on `control`, again whenever a heartbeat of that epoch arrives): the worker drops that
epoch's work and rejoins with a higher epoch, which re-admits it (registry.py; failures.py).

Two schedulers may run at once: one active, one standby (`services/standby.py`). The standby
reads nothing but its lease; on taking over it does what a restarted scheduler does (replays
the state and the fences, reads the request topics from the committed offsets). Its dispatches
and state records carry its lease term, and it acts only while its lease holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from aiokafka import TopicPartition

from services.scheduler.affinity import AffinityLimits, SessionAffinity, make_affinity
from services.scheduler.assignments import AssignmentTable
from services.scheduler.dispatch import Dispatcher, Pending
from services.scheduler.failures import FailureHandler
from services.scheduler.grants import GrantedCopies, GrantPublisher
from services.scheduler.liveness import Liveness
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement import PlacementDecision, WorkerLoad
from services.scheduler.placement_inputs import (
    be_capacity,
    build_placement,
    placement_request,
    session_kv,
    worker_load,
)
from services.scheduler.registry import WorkerRegistry
from services.scheduler.settings import SchedulerSettings
from services.standby import ActiveStandby
from shared.aio import run_on_event
from shared.broker_watch import BrokerRestart, BrokerWatch
from shared.kafka import NO_RESEND, KafkaClient, OffsetTracker, read_to_end, tail
from shared.metrics import ServiceMetrics
from shared.records import decode_record, record_key
from shared.schemas.capacity import BECapacity
from shared.schemas.control import Cancel, ControlEnvelope
from shared.schemas.requests import GenerateRequest
from shared.schemas.sessions import SessionLocation, SessionPlacement
from shared.schemas.telemetry import Telemetry
from shared.topics import Topics
from shared.tracing import Tracing, context_of, sent_ns

log = logging.getLogger(__name__)


class SchedulerService:
    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.kafka = KafkaClient(settings, settings.scheduler_id)
        self.registry = WorkerRegistry(settings.worker_timeout_s)
        # Tombstones carry the lease term like assignments (`self.lease` is made below, read later).
        self.assignments = AssignmentTable(self.kafka, self.topics.scheduler_state.name, lambda: self.lease.term)
        self.placement = build_placement(settings)
        self.affinity: SessionAffinity = make_affinity(
            settings.session_routing,
            AffinityLimits(settings.holder_room, settings.kv_high_water, settings.holder_slack),
        )
        self.pending: dict[str, deque[Pending]] = {"rt": deque(), "be": deque()}
        self.offsets = OffsetTracker()
        self.started = time.monotonic()  # when this instance became active
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.broker_watch = BrokerWatch(
            self.kafka, settings.topic_prefix, self._on_broker_restart, interval_s=settings.broker_watch_interval_s
        )
        self._req = None  # the request consumer, once active
        self.lease = ActiveStandby(
            self.kafka, self.topics.leases.name, "scheduler", settings.scheduler_id, settings.lease_s
        )
        self._init_metrics()
        self.dispatcher = Dispatcher(
            self.kafka, settings, self.assignments, self.affinity, self.registry, self.tracing, self.m, self.lease
        )
        self.failures = FailureHandler(
            self.kafka, settings, self.registry, self.assignments, self.m.rerouted, self.lease.is_active
        )
        term = lambda: self.lease.term  # noqa: E731
        self.grants = GrantPublisher(self.kafka, settings, self.placement, term)  # RT dispatch by grant
        self.granted = GrantedCopies(settings, self.registry, self.failures, self.m, term)
        self.liveness = Liveness(self)  # heartbeat intake and housekeeping

    def _init_metrics(self) -> None:
        self.metrics = ServiceMetrics("scheduler")
        self.tracing = Tracing("scheduler", self.metrics, self.settings.otlp_endpoint)
        self.m = SchedulerMetrics.register(self.metrics)

    # -- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        await self.kafka.start(self.topics.static())
        self.metrics.serve(self.settings.metrics_port)
        # Standby too: the watch rewinds the lease reader onto a restarted broker's new `leases`
        # topic; without it a standby read nothing there and deposed the active with claims it
        # never read back itself (docs/reliability.md, "Broker restarts").
        await self.broker_watch.start()
        await self.lease.start(self._activate)

    async def _activate(self, term: int) -> None:
        """Holding the lease: rebuild the state from Kafka and start placing."""
        await self.assignments.load()
        stale = (
            f" ({self.assignments.stale} stale records of a deposed scheduler dropped)"
            if self.assignments.stale
            else ""
        )
        log.info("recovered %d in-flight assignments%s", len(self.assignments.by_request), stale)
        fences = await self.failures.load_fences()
        if fences:
            log.info("remembered %d fenced worker epochs", fences)
        self._hb = await self._tail(self.topics.heartbeats.name)
        self.liveness.start(self._hb)
        self._tel = await self._tail(self.topics.telemetry.name)
        self._ctl = await self._tail(self.topics.control.name)
        self._dir = await self._replay(self.topics.sessions_directory.name, self._on_location)
        self._plc = await self._replay(self.topics.sessions_placement.name, self._on_placement)
        # Assigned, not subscribed: the lease already makes this the only reader, and a group join
        # would wait out the dead active's membership (seconds) on every takeover.
        self._req = await self.kafka.owned_consumer(
            self.topics.rt_requests.name, self.topics.be_requests.name, group="tandem-scheduler", hot=True
        )
        self.started = time.monotonic()
        self.m.active.set(1)
        loops = (
            self._request_loop(),
            self.liveness.heartbeat_loop(),
            self.liveness.follow_up_loop(),
            self._telemetry_loop(),
            self._control_loop(),
            self._placement_loop(),
            self.liveness.housekeeping_loop(),  # declares the silent lost (liveness.py)
            self._capacity_loop(),
            tail(self._dir, self._on_location, 100),
            tail(self._plc, self._on_placement, 100),
        )
        self._tasks = [asyncio.create_task(c) for c in loops]

    async def _tail(self, topic: str):
        c = await self.kafka.consumer(group=None)
        await self.kafka.assign_all(c, topic, from_end=True)
        return c

    async def _replay(self, topic: str, apply):
        """A compacted session topic, applied from its start (restart recovery), then tailed."""
        c = await self.kafka.consumer(group=None)
        await self.kafka.assign_all(c, topic, from_end=False)
        await read_to_end(c, apply)
        return c

    async def stop(self) -> None:
        await self.broker_watch.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._commit()
        if self.lease.is_active():  # gateways fall back to this path's successor at once
            await self.grants.revoke()
        await self.lease.stop()  # after the last commit: the successor starts from it
        await self.kafka.stop()
        self.tracing.shutdown()

    # -- input loops ---------------------------------------------------------------------

    async def _request_loop(self) -> None:
        while True:
            batches = await self._req.getmany(timeout_ms=100)
            for tp, msgs in batches.items():
                for m in msgs:
                    self._on_request(tp, m)
            if batches:
                self._wake.set()

    def _on_request(self, tp: TopicPartition, m) -> None:
        offset = m.offset
        self.offsets.started(tp, offset)
        req = decode_record(GenerateRequest, m)
        if req is None:  # malformed: logged, and committed past like a finished one
            self.offsets.done(tp, offset)
            return
        placed = self.assignments.get(req.request_id)
        if placed is not None and placed.attempt >= req.attempt:
            self.offsets.done(tp, offset)  # redelivered after a restart: already placed
            return
        read_ns, trace = time.time_ns(), context_of(m.headers)
        # its spans are recorded once it is dispatched (dispatch.py), off the request's path
        p = Pending(req, tp, offset, trace, read_ns, sent_ns(m.headers))
        (self.granted.queue if req.granted_worker else self.pending[req.req_class]).append(p)
        log.log(self.broker_watch.recovery.level(), "received", extra={"request_id": req.request_id})

    async def _telemetry_loop(self) -> None:
        while True:
            t = decode_record(Telemetry, await self._tel.getone())
            if t is not None:
                self.registry.on_telemetry(t)
                self._wake.set()

    async def _control_loop(self) -> None:
        while True:
            envelope = decode_record(ControlEnvelope, await self._ctl.getone())
            if envelope is not None and isinstance(envelope.message, Cancel):
                self._drop_pending(envelope.message.request_id)

    def _on_location(self, m) -> None:
        location = decode_record(SessionLocation, m, tombstone_ok=True)
        if location is not None:
            self.affinity.on_location(location)

    def _on_placement(self, m) -> None:
        session_id = record_key(m)
        placement = decode_record(SessionPlacement, m, tombstone_ok=True)
        if session_id is not None and (placement is not None or m.value is None):
            self.affinity.on_placement(session_id, placement)

    def _drop_pending(self, request_id: str) -> None:
        for queue in self.pending.values():
            for p in [p for p in queue if p.request.request_id == request_id]:
                queue.remove(p)
                self.offsets.done(p.tp, p.offset)

    # -- placement -----------------------------------------------------------------------

    async def _placement_loop(self) -> None:
        # A failed round (a send failed, e.g. the broker restarting) leaves the request's offset
        # uncommitted, and its assignment is re-routed if unaccounted.
        await run_on_event(self._wake, self._placement_round, failed="placement round failed", logger=log)

    async def _placement_round(self) -> None:
        try:
            await self._place_pending()
        finally:  # what was placed before a failure is still committed
            await self._commit()
            self._flow_control()

    async def _on_broker_restart(self, restart: BrokerRestart) -> None:
        """The broker lost its data (requests, state topic, group offsets). Requests read before
        the restart are forgotten: their gateways end those streams, the queue re-releases its
        items, and every request topic is read again from its new beginning (the watch rewound
        the consumer). Assignments made before the last check that still saw the old broker are
        dropped (the new state topic does not hold them); later ones are kept, since they may be
        placements of new requests, and dropping those would place them twice. A standby holds
        none of this: the repair (its lease reader rewound) is all it needs."""
        self.lease.broker_restarted()  # terms start again on the new `leases` topic, standby too
        self.liveness.broker_restarted()  # the workers' silence meanwhile was the broker's
        if not self.lease.term:
            log.warning("broker restarted while standing by: topics repaired, lease reader rewound")
            return
        self.pending = {"rt": deque(), "be": deque()}
        self.granted.clear()
        self.offsets = OffsetTracker()  # old offsets mean nothing in the new topics
        self.affinity.forget_terms()  # lease terms start again at 1 on the new broker
        old = [a.request_id for a in self.assignments.by_request.values() if a.assigned_at < restart.last_seen_alive]
        for request_id in old:
            self.assignments.by_request.pop(request_id, None)
        self.assignments.landed.clear()  # offsets on the old topics: no sign on the new (failures.py)
        log.warning("broker restarted: dropped %d assignments and the pending requests", len(old))
        self._wake.set()

    async def _place_pending(self) -> None:
        if not self.lease.is_active():
            return  # the lease lapsed (a long pause, the broker away): place once it is renewed
        await self.granted.settle(self.offsets, self.started)  # the gateways' granted placements
        for cls in ("rt", "be"):
            queue = self.pending[cls]
            while queue:
                p = queue[0]
                loads = self._loads(p.request.model)
                decision = self._choose(p.request, loads)
                if decision.worker_id is None:
                    break  # FIFO within a class: nothing behind it fits either
                queue.popleft()
                if decision.meets_slo is False and self.settings.slo_overload == "reject":
                    await self.dispatcher.reject(p, decision)
                else:
                    self._count_decision(p.request, decision)
                    landed = await self.dispatcher.dispatch(p, decision.worker_id, {w.worker_id for w in loads})
                    level = self.broker_watch.recovery.level()  # DEBUG: dispatch.py logs it there
                    if level > logging.DEBUG:
                        log.log(
                            level,
                            "placed on %s (%s[%d]@%d)",
                            decision.worker_id,
                            landed.topic,
                            landed.partition,
                            landed.offset,
                            extra={"request_id": p.request.request_id},
                        )
                self.offsets.done(p.tp, p.offset)  # both written and acknowledged
            self.m.pending.labels(cls).set(len(queue))

    def _choose(self, req: GenerateRequest, loads: list[WorkerLoad]) -> PlacementDecision:
        """A session's RT turn goes where its affinity says (placement or holder), else by load.
        A policy that predicts SLOs (`slo`) gets the affinity's pick as a preference instead,
        and takes it only when the SLO holds there."""
        routed = self.affinity.route(req.session_id, loads) if req.req_class == "rt" else None
        if routed is not None and self.settings.placement != "slo":
            return PlacementDecision(routed, "session affinity")
        live = {w.worker_id for w in loads}
        session = session_kv(self.affinity.directory, req.session_id, live) if req.session_id else None
        return self.placement.decide(placement_request(req, self.settings, session, routed), loads)

    def _count_decision(self, req: GenerateRequest, d: PlacementDecision) -> None:
        outcome = {True: "meets_slo", False: "over_slo_admitted", None: "unpredicted"}[d.meets_slo]
        self.m.decisions.labels(req.req_class, outcome).inc()
        if d.predicted_ttft_s is not None:
            self.m.predicted.observe(d.predicted_ttft_s)
        if d.meets_slo is False:
            log.info("admitted over its SLO: %s", d.reason, extra={"request_id": req.request_id})

    def _loads(self, model: str) -> list[WorkerLoad]:
        counts = self.assignments.counts()
        return [worker_load(w, counts) for w in self.registry.live() if w.heartbeat.model == model]

    async def _grant(self) -> None:
        """Publish the RT grant if it changed or is due (grants.py); only the active grants."""
        if self.grants.enabled and self.lease.is_active():
            counts = self.assignments.counts()
            live = [(worker_load(w, counts), w.heartbeat.model, w.heartbeat.epoch) for w in self.registry.live()]
            await self.grants.maybe_publish(live)

    async def _commit(self) -> None:
        offsets = self.offsets.committable()
        if offsets and self.lease.is_active():
            try:
                await self._req.commit(offsets)
            except Exception:  # noqa: BLE001 (a rebalance in progress: the next round commits)
                log.warning("offset commit failed", exc_info=True)

    def _flow_control(self) -> None:
        """Stop reading BE from Kafka while too much is already held in memory."""
        be_parts = [tp for tp in self._req.assignment() if tp.topic == self.topics.be_requests.name]
        if len(self.pending["be"]) >= self.settings.max_pending:
            self._req.pause(*be_parts)
        else:
            self._req.resume(*be_parts)

    async def _capacity_loop(self) -> None:
        """Tell the queue service how much BE the workers can absorb (its release budget)."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            if not self.lease.is_active():
                continue
            try:
                await self.kafka.send(
                    self.topics.be_capacity.name, self._be_capacity(), key=self.settings.scheduler_id, resend=NO_RESEND
                )
            except Exception:  # noqa: BLE001 (the broker may be briefly away; the next round retries)
                log.warning("BE capacity not published", exc_info=True)

    def _be_capacity(self) -> BECapacity:
        loads = {m: self._loads(m) for m in sorted({w.heartbeat.model for w in self.registry.live()})}
        counts, pending = self.assignments.counts(), len(self.pending["be"])
        return be_capacity(self.settings.scheduler_id, self.placement, loads, counts, pending)
