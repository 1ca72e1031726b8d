"""What the scheduler does when a worker or a request is lost: re-place (`Rerouted` to the owner)
and fence the lost epoch.

A fence is published on `control` (workers and gateways act on it) and remembered on the
compacted `scheduler.fences` topic (key: worker id, value: the highest fenced epoch). A scheduler
that starts, or a standby that takes over, reads that topic back (`load_fences`), so a worker
still stale at that moment is fenced again instead of admitted at its lost epoch; the queue and
advisory services read the same topic into their live-worker views (`shared/fence_feed.py`).

Everything here acts only while this scheduler holds its lease (`is_active`): a paused active
that wakes must not re-place or fence on its stale view.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import Counter

from services.scheduler.assignments import AssignmentTable
from services.scheduler.registry import WorkerInfo, WorkerRegistry
from services.scheduler.settings import SchedulerSettings
from shared.kafka import KafkaClient, read_to_end
from shared.records import decode_record
from shared.schemas.control import ControlEnvelope, Fence
from shared.schemas.results import Rerouted, ResultBatch
from shared.schemas.scheduler import Assignment
from shared.topics import Topics

log = logging.getLogger(__name__)


class FailureHandler:
    def __init__(
        self,
        kafka: KafkaClient,
        settings: SchedulerSettings,
        registry: WorkerRegistry,
        assignments: AssignmentTable,
        rerouted: Counter,
        is_active: Callable[[], bool],
    ) -> None:
        self.kafka, self.settings, self.registry, self.assignments = kafka, settings, registry, assignments
        self.topics = Topics(settings.topic_prefix)
        self._rerouted = rerouted
        self._is_active = is_active
        self._fence_sent: dict[str, float] = {}  # worker id -> when its fence was last published

    async def load_fences(self) -> int:
        """Read the remembered fences back (start or takeover); returns how many."""
        consumer = await self.kafka.consumer(group=None)

        def apply(m) -> None:
            fence = decode_record(Fence, m)
            if fence is not None:
                self.registry.remember_fence(fence.worker_id, fence.epoch)

        try:
            await self.kafka.assign_all(consumer, self.topics.scheduler_fences.name, from_end=False)
            await read_to_end(consumer, apply)
        finally:
            await consumer.stop()
        return len(self.registry.fenced)

    async def worker_lost(self, worker_id: str) -> None:
        """Re-place everything a lost worker held, then fence its epoch."""
        log.warning("worker %s lost: re-placing its requests", worker_id)
        for a in self.assignments.on_worker(worker_id):
            await self.reroute(a, f"worker {worker_id} lost")
        await self.fence(worker_id)

    async def fence(self, worker_id: str, resend: bool = False) -> None:
        """Publish (and remember) the fence of a lost worker's epoch (re-sent at most once per
        heartbeat interval: a stale worker heartbeats that often until it has rejoined)."""
        now = time.monotonic()
        if resend and now - self._fence_sent.get(worker_id, 0.0) < self.settings.heartbeat_interval_s:
            return
        if not self._is_active():
            return
        self._fence_sent[worker_id] = now
        fence = Fence(worker_id=worker_id, epoch=self.registry.fenced[worker_id])
        try:
            await self.kafka.send(self.topics.scheduler_fences.name, fence, key=worker_id)
            await self.kafka.send(self.topics.control.name, ControlEnvelope(message=fence), key=worker_id)
        except Exception:  # noqa: BLE001 (the broker is briefly away: its next stale heartbeat re-sends it)
            log.warning("fence of worker %s not published", worker_id, exc_info=True)

    async def retire_finished(self, info: WorkerInfo | None) -> None:
        if info is None:
            return
        for a in self.assignments.on_worker(info.heartbeat.worker_id):
            if f"{a.request_id}:{a.attempt}" in info.finished:
                await self.assignments.remove(a.request_id)

    async def reroute_unaccounted(self, active_since: float) -> None:
        """Assignments the worker neither runs nor finished (lost dispatch, or a worker we never
        saw), `unknown_request_grace_s` after they were made; but not a dispatch still being sent,
        nor one its worker's heartbeat says it has not read yet (`_unread`)."""
        if time.monotonic() - active_since < self.settings.worker_timeout_s:
            return  # just started or took over: heartbeats are still arriving
        for a in self.assignments.older_than(self.settings.unknown_request_grace_s):
            info = self.registry.workers.get(a.worker_id)
            key = f"{a.request_id}:{a.attempt}"
            if info is not None and (key in info.running or key in info.finished):
                continue
            if a.request_id in self.assignments.sending or self._unread(a, info):
                continue
            await self.reroute(a, "request unaccounted for")

    def _unread(self, a: Assignment, info: WorkerInfo | None) -> bool:
        """The worker has not read `a`'s dispatch yet, by its latest heartbeat, and the dispatch
        is younger than `unread_dispatch_grace_s`. Why (issue 22, tenth session): under load a
        worker's dispatch reader can lag more than the 3 s grace behind its heartbeats, and a
        dispatch merely late was re-routed: the gateway re-submitted it, it ran on both workers
        (the client's text stayed right: the gateway drops the old attempt's tokens). A worker
        that has read past it and lists it nowhere dropped it (a fenced epoch, a stale term):
        re-routed at the grace as before. A worker without the field (older) or a dispatch whose
        landing is unknown (a gateway's granted copy) keeps the grace alone."""
        landed = self.assignments.landed.get(a.request_id)
        position = info.heartbeat.dispatch_position if info is not None else None
        if landed is None or landed[0] != a.attempt or position is None or position > landed[1]:
            return False
        return time.time() - a.assigned_at < self.settings.unread_dispatch_grace_s

    async def reroute(self, a: Assignment, reason: str) -> None:
        """Tell `a`'s owner to re-submit it, then forget it. Never raises: a send the broker
        refused (after a restart) leaves the assignment in place, and the next pass (a housekeeping
        tick) tries again. It used to raise out of the housekeeping loop and end it for good: no
        worker was declared lost and no request re-routed after that (a recovery probe waited out
        the gateway's 60 s, `tandem chaos --faults broker`, tenth session)."""
        if not self._is_active():
            return  # a deposed scheduler's view is stale: its successor decides
        event = Rerouted(request_id=a.request_id, attempt=a.attempt, reason=reason)
        try:
            await self.kafka.send(
                self.topics.results.name,
                ResultBatch(source=self.settings.scheduler_id, events=[event]),
                partition=a.reply_partition,
            )
        except Exception as exc:  # noqa: BLE001 (the broker away or refusing: the next pass tries again)
            log.warning("rerouting (%s) not sent: %r; trying again", reason, exc, extra={"request_id": a.request_id})
            return
        try:
            await self.assignments.remove(a.request_id)
        except Exception as exc:  # noqa: BLE001 (forgotten here; only a successor replaying the state would see it)
            log.warning("tombstone of a re-routed assignment not written: %r", exc, extra={"request_id": a.request_id})
        self._rerouted.inc()
        log.info("rerouting: %s", reason, extra={"request_id": a.request_id})
