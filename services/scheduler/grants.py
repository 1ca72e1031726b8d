"""RT dispatch by grant (issue 21, tenth session): the scheduler lends the gateways RT slots on
its workers and records what they placed in them (docs/services.md, "RT dispatch by grant").

Three hops (gateway → scheduler → worker → gateway) cannot bring the first token's added time
under 5 ms on a 2-core host (docs/services.md, the ninth session's floor). With a grant the
gateway sends an RT request straight to a worker's dispatch topic and a copy flagged
`granted_worker` to `requests.rt`: the first token crosses two hops, and the scheduler still
decides where RT may go (which workers, how many at once) and learns of every placement.

`GrantPublisher` publishes, while this scheduler is active, a `PlacementGrant` on
`placement.grants`: for each live, non-draining worker where the placement policy would put an
RT request now (`decide` on that worker alone: with `slo` placement, not where the SLO is
predicted to fail), `min(grant_slots, free sequence slots)` slots per gateway. It publishes when
the grant changes (a worker joined, was lost, drains, filled up) and otherwise every heartbeat
interval, good for `grant_ttl_s` (by default the worker timeout: the silence after which a worker
is declared lost) after a gateway reads it, so a scheduler that dies stops granting within
that; a clean stop revokes at once.

`GrantedCopies` settles the flagged copies the scheduler reads:
- the granted worker is live at the stamped epoch: the placement is recorded as this
  scheduler's own (`scheduler.state`), whatever term the gateway's grant carried, so worker
  loss, retries, unaccounted requests and `tandem status` treat it like any other. A copy that
  arrives after the request finished is recorded too; the worker's next heartbeat (which lists
  it as finished) retires it.
- the worker was lost at that epoch (fenced), rejoined at a newer one, or is still unknown once
  this scheduler has been active longer than the worker timeout: the request is re-routed to its
  gateway (`Rerouted`), which resumes it through the scheduler's path with the tokens its client
  has, exactly as after a worker loss. Nothing is lost; a stale grant costs a resume.
- the worker is unknown and this scheduler has just started (heartbeats still arriving): wait.

Decisions on the design's open points: the grant is one record for all gateways (not split per
gateway): `slots` is per gateway, so a worker can get up to `slots × gateways` RT requests the
scheduler did not pick at that moment, the bound the design names; sessions and BE keep the
scheduler's path; a granted dispatch with a term older than one its worker has seen is dropped
by the worker and re-placed as unaccounted after `unknown_request_grace_s` (the rare case of a
scheduler failover that the gateway has not yet seen).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from services.scheduler.dispatch import Pending
from services.scheduler.failures import FailureHandler
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement import PlacementPolicy, PlacementRequest, WorkerLoad
from services.scheduler.registry import WorkerRegistry
from services.scheduler.settings import SchedulerSettings
from shared.aio import within
from shared.kafka import NO_RESEND, KafkaClient, OffsetTracker
from shared.schemas.grants import PlacementGrant, WorkerGrant
from shared.schemas.scheduler import Assignment
from shared.topics import Topics

log = logging.getLogger(__name__)
REVOKE_S = 2.0  # a stop with the broker gone must not wait out the producer's timeout
_PROBE = PlacementRequest(request_id="grant-probe", req_class="rt")  # a typical RT request: size unknown


class GrantPublisher:
    def __init__(
        self,
        kafka: KafkaClient,
        settings: SchedulerSettings,
        placement: PlacementPolicy,
        term: Callable[[], int],
    ) -> None:
        self.kafka, self.settings, self.placement, self._term = kafka, settings, placement, term
        self.topic = Topics(settings.topic_prefix).placement_grants.name
        # Good for as long as a silent worker stays live (a dead scheduler's grant lapses as a dead
        # worker is declared lost); refreshed every heartbeat interval, a third of that.
        self.ttl_s = settings.grant_ttl_s or settings.worker_timeout_s
        self.refresh_s = settings.heartbeat_interval_s or settings.worker_timeout_s / 3
        self.sequence = 0
        self._last: tuple[int, list[WorkerGrant]] | None = None  # (term, workers) last published
        self._sent_at = 0.0  # monotonic

    @property
    def enabled(self) -> bool:
        return self.settings.rt_grants

    def workers(self, live: list[tuple[WorkerLoad, str, int]]) -> list[WorkerGrant]:
        """The grant's workers, from each live worker's (load, model, epoch)."""
        out = []
        for w, model, epoch in live:
            if w.draining:
                continue
            decision = self.placement.decide(_PROBE, [w])
            if decision.worker_id is None or decision.meets_slo is False:
                continue
            slots = min(self.settings.grant_slots, max(0, w.max_num_seqs - w.rt))
            if slots:
                out.append(WorkerGrant(worker_id=w.worker_id, epoch=epoch, model=model, slots=slots))
        return out

    async def maybe_publish(self, live: list[tuple[WorkerLoad, str, int]]) -> None:
        """Publish when the grant changed, or when its refresh is due."""
        if not self.enabled:
            return
        workers = self.workers(live)
        term = self._term()
        due = time.monotonic() - self._sent_at >= self.refresh_s
        if not due and self._last == (term, workers):
            return
        await self._publish(term, workers)

    async def revoke(self) -> None:
        """A clean stop: gateways fall back to the scheduler's path at once (not after the TTL)."""
        if self.enabled and self._last is not None:
            try:
                await within(self._publish(self._term(), []), REVOKE_S)
            except TimeoutError:
                log.warning("grant not revoked within %.0fs: it lapses after its TTL", REVOKE_S)

    async def _publish(self, term: int, workers: list[WorkerGrant]) -> None:
        self.sequence += 1
        grant = PlacementGrant(
            scheduler_id=self.settings.scheduler_id,
            term=term,
            sequence=self.sequence,
            sent_at=time.time(),
            ttl_s=self.ttl_s,
            workers=workers,
        )
        try:
            await self.kafka.send(self.topic, grant, key=self.settings.scheduler_id, resend=NO_RESEND)
        except Exception:  # noqa: BLE001 (the broker is briefly away: the next refresh sends it)
            log.warning("grant not published", exc_info=True)
            return
        if self._last is None or self._last[1] != workers:
            log.info("granted %s (term %d, seq %d)", {g.worker_id: g.slots for g in workers}, term, self.sequence)
        self._last, self._sent_at = (term, workers), time.monotonic()


class GrantedCopies:
    """The gateways' granted placements, read from `requests.rt`, settled (module docstring)."""

    def __init__(
        self,
        settings: SchedulerSettings,
        registry: WorkerRegistry,
        failures: FailureHandler,
        metrics: SchedulerMetrics,
        term: Callable[[], int],
    ) -> None:
        self.settings, self.registry, self.failures, self.m = settings, registry, failures, metrics
        self._term = term
        self.queue: deque[Pending] = deque()

    def clear(self) -> None:
        self.queue.clear()

    async def settle(self, offsets: OffsetTracker, active_since: float) -> None:
        """Record or re-route every copy that can be decided now; the rest wait (module docstring).
        A copy whose write fails (the broker briefly away) stays queued for the next round: its
        request runs on the granted worker, and a copy dropped from memory would leave the
        scheduler blind to it (no re-placement if that worker dies)."""
        for p in list(self.queue):
            verdict = self._verdict(p, active_since)
            if verdict is None:
                continue
            a = self._assignment(p)
            if verdict == "adopt":
                await (await self.failures.assignments.add_nowait(a))
                self.m.placed.labels("rt").inc()
                self.m.decisions.labels("rt", "granted").inc()
            else:
                await self.failures.reroute(a, verdict)
            self.queue.remove(p)
            offsets.done(p.tp, p.offset)  # written and acknowledged

    def _verdict(self, p: Pending, active_since: float) -> str | None:
        """ "adopt", a re-route's reason, or None: wait for the worker's heartbeats."""
        req = p.request
        worker, epoch = req.granted_worker or "", req.worker_epoch or 0
        info = self.registry.workers.get(worker)
        if info is not None and info.heartbeat.epoch == epoch:
            return "adopt"
        if self.registry.fenced.get(worker, -1) >= epoch or (info is not None and info.heartbeat.epoch > epoch):
            return f"granted worker {worker} lost at epoch {epoch}"
        if info is None and time.monotonic() - active_since > self.settings.worker_timeout_s:
            return f"granted worker {worker} unknown"
        return None

    def _assignment(self, p: Pending) -> Assignment:
        req = p.request
        return Assignment(
            request_id=req.request_id,
            attempt=req.attempt,
            worker_id=req.granted_worker or "",
            gateway_id=req.gateway_id,
            reply_partition=req.reply_partition,
            req_class=req.req_class,
            assigned_at=time.time(),
            term=self._term(),
        )
