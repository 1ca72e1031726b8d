"""Writing a placement: the assignment to `scheduler.state` and the request to its worker's
dispatch topic, both stamped with this scheduler's lease term (and the worker's epoch), or a
rejection to the request's owner. The caller commits the request's offset once this returns."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from aiokafka import TopicPartition
from aiokafka.structs import RecordMetadata
from opentelemetry.context import Context

from services.scheduler.affinity import SessionAffinity
from services.scheduler.assignments import AssignmentTable
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement import PlacementDecision
from services.scheduler.placement_inputs import rejection
from services.scheduler.registry import WorkerRegistry
from services.scheduler.settings import SchedulerSettings
from services.standby import ActiveStandby
from shared.kafka import KafkaClient
from shared.schemas.requests import GenerateRequest
from shared.schemas.results import ResultBatch
from shared.schemas.scheduler import Assignment
from shared.topics import Topics
from shared.tracing import Tracing

log = logging.getLogger(__name__)


@dataclass
class Pending:
    request: GenerateRequest
    tp: TopicPartition
    offset: int
    trace: Context | None = None  # the request's trace context, from its record's headers
    read_ns: int = 0  # when this scheduler read it (wall clock, for the `scheduler.place` hop)
    sent_ns: int | None = None  # when the gateway sent it (its headers; the `scheduler.consume` hop)


class Dispatcher:
    def __init__(
        self,
        kafka: KafkaClient,
        settings: SchedulerSettings,
        assignments: AssignmentTable,
        affinity: SessionAffinity,
        registry: WorkerRegistry,
        tracing: Tracing,
        metrics: SchedulerMetrics,
        lease: ActiveStandby,
    ) -> None:
        self.kafka, self.settings, self.assignments, self.affinity = kafka, settings, assignments, affinity
        self.registry, self.tracing, self.m, self.lease = registry, tracing, metrics, lease
        self.topics = Topics(settings.topic_prefix)

    async def dispatch(self, p: Pending, worker_id: str, live: set[str]) -> RecordMetadata:
        """Write the assignment and send the request to the worker's dispatch topic; returns where
        the dispatch landed (logged after a broker restart: which partition and offset to look for)."""
        req = p.request
        kv_source = self.affinity.kv_source(req.session_id, worker_id, live)
        # kv_source: where this worker can pull the KV; worker_epoch: a fenced worker drops it
        epoch = self.registry.workers[worker_id].heartbeat.epoch
        term = self.lease.term  # a worker drops dispatches of a term older than one it has seen
        req = req.model_copy(update={"kv_source": kv_source, "worker_epoch": epoch, "scheduler_term": term})
        a = Assignment(
            request_id=req.request_id,
            attempt=req.attempt,
            worker_id=worker_id,
            gateway_id=req.gateway_id,
            reply_partition=req.reply_partition,
            req_class=req.req_class,
            assigned_at=time.time(),
            term=term,
        )
        # State and dispatch are written concurrently (one round trip, not two); the request's
        # offset is committed only after both are acknowledged, so a crash in between redelivers
        # it, and a restarted scheduler that finds the state record does not place it twice.
        # While it is being sent (a refused one is re-sent for seconds after a broker restart) it
        # is not "unaccounted" (failures.py): re-routing it then could run it twice.
        self.assignments.sending.add(req.request_id)
        try:
            state_ack = await self.assignments.add_nowait(a)
            send_ns = time.time_ns()
            dispatch_ack = await self.kafka.send_nowait(
                self.topics.dispatch(worker_id).name, req, key=req.request_id, headers=Tracing.kafka_headers(p.trace)
            )
            _, landed = await asyncio.gather(state_ack, dispatch_ack)
        finally:
            self.assignments.sending.discard(req.request_id)
        self.assignments.dispatched(a, landed.offset)
        # Spans cost the loop ~50-120 us each: recorded once the dispatch has left, not on its way
        # (issue 21, ninth session; services/worker/requests.py does the same).
        if p.sent_ns is not None:
            self.tracing.hop("scheduler.consume", p.trace, p.sent_ns, p.read_ns)
        if p.read_ns:
            self.tracing.hop("scheduler.place", p.trace, p.read_ns, send_ns)
        self.tracing.hop("scheduler.produce", p.trace, send_ns)
        self._count_session_turn(req, worker_id, live)
        self.affinity.placed(req.session_id, worker_id)
        self.m.placed.labels(req.req_class).inc()
        log.debug(
            "dispatched to %s%s",
            worker_id,
            f" (KV from {kv_source.worker_id})" if kv_source else "",
            extra={"request_id": req.request_id},
        )
        return landed

    def _count_session_turn(self, req: GenerateRequest, worker_id: str, live: set[str]) -> None:
        if req.session_id is None:
            return
        placement = self.affinity.placements.live(req.session_id)
        if placement is not None and placement.worker_id == worker_id:
            route = "placement"
        elif self.affinity.holder(req.session_id, live) == worker_id:
            route = "holder"
        else:
            route = "moved" if req.kv_source is not None else "other"
        self.m.sessions.labels(route).inc()

    async def reject(self, p: Pending, d: PlacementDecision) -> None:
        """No worker can serve this RT request in time: its owner answers 429 with Retry-After."""
        req = p.request
        await self.kafka.send(
            self.topics.results.name,
            ResultBatch(source=self.settings.scheduler_id, events=[rejection(req, d)]),
            partition=req.reply_partition,
        )
        self.m.decisions.labels(req.req_class, "rejected").inc()
        log.info("rejected: %s", d.reason, extra={"request_id": req.request_id})
