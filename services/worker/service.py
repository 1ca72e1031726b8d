"""The worker service: one engine per process, fed by its dispatch topic.

Tasks: read dispatch (`RequestRunner`, requests.py: admission and one stream task per request),
read control (cancel, drain, fence, prefetch), read the owners' (gateways') heartbeats and cancel
a dead owner's requests (owners.py), publish heartbeats and telemetry (`WorkerReports`,
reports.py). Token deltas leave through `ResultOutbox`, one message per gateway partition per
engine step.

The engine is reached only through `AsyncLLM` (its methods, `info` and `snapshot()`): it runs on
its own thread, which also owns the tokenizer, so prompts travel to it as text or chats.

Epochs: the worker heartbeats an epoch (its start time in ms). If the scheduler declared it lost
(a long pause, a starved machine) it sends a `Fence` for that epoch: the worker cancels what it
runs (the scheduler re-placed all of it; the owners drop the old attempts' results), drops
dispatches stamped with a fenced epoch, and rejoins at the next epoch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
import uuid

from aiokafka import AIOKafkaConsumer

from engine.async_llm import AsyncLLM
from services.worker.outbox import ResultOutbox
from services.worker.owners import OwnerWatch
from services.worker.reports import WorkerIdentity, WorkerReports
from services.worker.requests import RequestRunner
from services.worker.sessions import WorkerSessions
from services.worker.settings import WorkerSettings
from services.worker.telemetry import TelemetryWindow
from shared.broker_watch import BrokerRestart, BrokerWatch
from shared.hearing import Hearing
from shared.kafka import KafkaClient, fetch_decoded
from shared.metrics import ServiceMetrics
from shared.records import decode_record
from shared.schemas.control import Cancel, ControlEnvelope, Drain, Fence, Prefetch
from shared.schemas.results import Failed
from shared.schemas.telemetry import OwnerHeartbeat
from shared.topics import Topics
from shared.tracing import Tracing

log = logging.getLogger(__name__)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def served_name(settings: WorkerSettings) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    return "default" if settings.model == "default" else os.path.basename(settings.model.rstrip("/"))


class WorkerService:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id or default_worker_id()
        started_at = time.time()
        self.identity = WorkerIdentity(self.worker_id, served_name(settings), started_at, int(started_at * 1000))
        self.topics = Topics(settings.topic_prefix)
        self.kafka = KafkaClient(settings, f"worker-{self.worker_id}")
        self.session_dir = settings.resolved_session_dir(self.worker_id)
        self.llm = AsyncLLM(settings.engine_config(self.session_dir))
        self.outbox = ResultOutbox(self.kafka, self.topics.results.name, self.worker_id)
        self.sessions = WorkerSessions(
            self.llm, self.kafka, self.topics.sessions_directory.name, self.worker_id, settings, self.session_dir
        )
        self.metrics = ServiceMetrics("worker")
        self.tracing = Tracing("worker", self.metrics, settings.otlp_endpoint)
        telemetry = TelemetryWindow()
        self.owners = OwnerWatch(settings.worker_timeout_s)
        self.runner = RequestRunner(
            self.worker_id,
            self.llm,
            self.outbox,
            self.sessions,
            self.tracing,
            telemetry,
            self.owners.is_dead,
            settings.accept_hold_s,
        )
        self.reports = WorkerReports(
            settings,
            self.identity,
            self.kafka,
            self.topics,
            self.llm,
            self.runner,
            self.sessions,
            telemetry,
            self.metrics,
        )
        self._background: list[asyncio.Task] = []
        self.owner_hearing: Hearing | None = None  # up to when the owners' beats were all read
        self._commit_timer: asyncio.TimerHandle | None = None  # the deferred dispatch commit
        self._background_commits: set[asyncio.Task] = set()
        # After a broker restart a worker needs the repair (its dispatch topic recreated with one
        # partition, its readers rewound) and to forget its term floors: what it runs belongs to
        # owners that react themselves.
        self.broker_watch = BrokerWatch(
            self.kafka, settings.topic_prefix, self._on_broker_restart, interval_s=settings.broker_watch_interval_s
        )
        self.runner.receipt_level = self.broker_watch.recovery.level
        self.outbox.ack_level = self.broker_watch.recovery.level

    async def _on_broker_restart(self, restart: BrokerRestart) -> None:
        """Lease terms are counted on the broker's `leases` topic, which a restart empties: a
        scheduler or advisory service started after it claims term 1 again, and a floor kept
        from before would drop all its dispatches and prefetches (broker + scheduler never
        recovered that way, `tandem chaos`). A surviving active renews at its own term, which
        sets the floor again at once."""
        self.runner.scheduler_term = 0
        self.sessions.advisory_term = 0
        # The gateways' silence meanwhile was the broker's (owners.py).
        self.owners.hear_all_now()
        if self.owner_hearing is not None:
            self.owner_hearing.restart()

    # -- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        # The engine thread holds the GIL through long stretches of Python between tensor ops; a
        # short switch interval lets the event-loop thread forward tokens without waiting the
        # default 5 ms for its turn (that wait showed up as +10 ms per token on the Kafka path).
        sys.setswitchinterval(self.settings.gil_switch_interval_s)
        await self.llm.start()
        loaded = time.monotonic()
        dispatch = self.topics.dispatch(self.worker_id)
        await self.kafka.start([*self.topics.static(), dispatch])
        await self.sessions.start()
        # Assigned, not subscribed: no group join round before the first dispatch is read.
        self._dispatch = await self.kafka.owned_consumer(
            dispatch.name, group=f"tandem-worker-{self.worker_id}", hot=True
        )
        self.reports.dispatch_reader = self._dispatch  # heartbeats say how far it has read
        self._control = await self.kafka.consumer(group=None)
        await self.kafka.assign_all(self._control, self.topics.control.name, from_end=True)
        self._owners_in = await self.kafka.consumer(group=None)
        await self.kafka.assign_all(self._owners_in, self.topics.owners.name, from_end=True)
        probe_s = max(self.settings.heartbeat_interval_s, 1.0)
        self.owner_hearing = Hearing(self._owners_in, probe_timeout_s=probe_s, what="gateway heartbeat")
        loops = (
            self._dispatch_loop(),
            self._control_loop(),
            self._owners_loop(),
            self._owners_probe_loop(),
            self._heartbeat_loop(),
            self._telemetry_loop(),
        )
        self._background = [asyncio.create_task(c) for c in loops]
        await self.reports.send_heartbeat()
        await self.broker_watch.start()
        self.metrics.serve(self.settings.metrics_port)
        log.info(
            "worker %s serving %r (dispatch topic %s; consuming %.2fs after the model was loaded)",
            self.worker_id,
            self.identity.model_name,
            dispatch.name,
            time.monotonic() - loaded,
        )

    async def stop(self) -> None:
        """Drain: stop taking work, let running requests finish (bounded), flush, close."""
        self.identity.draining = True
        if self._background:  # it served (a stop during start has no engine info to announce)
            await self.reports.send_heartbeat()
        await self.runner.drain(self.settings.drain_timeout_s)
        for t in self._background:
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._commit_timer is not None:  # what was accepted is committed before leaving
            self._commit_timer.cancel()
            self._commit_timer = None
            await self._commit_now()
        await asyncio.gather(*self._background_commits, return_exceptions=True)
        await self.broker_watch.stop()
        await self.outbox.drain()
        await self.sessions.stop()
        await self.kafka.stop()
        self.tracing.shutdown()
        await self.llm.shutdown()

    # -- dispatch ------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        consumer: AIOKafkaConsumer = self._dispatch
        while True:
            batches = await consumer.getmany(timeout_ms=100)
            for messages in batches.values():
                for msg in messages:
                    self.runner.accept(msg)
            if batches and self._commit_timer is None:
                delay = self.settings.dispatch_commit_delay_s
                self._commit_timer = asyncio.get_running_loop().call_later(delay, self._commit_dispatches)

    def _commit_dispatches(self) -> None:
        """Commit what was accepted so far (a redelivery would be a duplicate), some
        `dispatch_commit_delay_s` after the accept: committed at once, the commit's broker round
        trip ran on this event loop while the engine computed the request's first token, and a
        Kafka call there measured +1.2 to +3.9 ms on that hop (docs/services.md). The cost of the
        delay: a worker that crashes within it gets those dispatches again when it restarts
        (re-run, as any redelivery; their owners already ignore the old attempts' results)."""
        self._commit_timer = None
        task = asyncio.ensure_future(self._commit_now())
        self._background_commits.add(task)
        task.add_done_callback(self._background_commits.discard)

    async def _commit_now(self) -> None:
        try:
            await self._dispatch.commit()
        except Exception:  # noqa: BLE001 (the broker briefly away: the next accept commits again)
            log.warning("dispatch offsets not committed", exc_info=True)

    # -- control -------------------------------------------------------------------------

    async def _control_loop(self) -> None:
        while True:
            envelope = decode_record(ControlEnvelope, await self._control.getone())
            if envelope is None:
                continue  # malformed: logged and skipped
            cmd = envelope.message
            if isinstance(cmd, Cancel):
                if self.runner.cancel(cmd.request_id):  # leaving the engine stream frees its KV
                    log.info("cancelled", extra={"request_id": cmd.request_id})
            elif isinstance(cmd, Prefetch):  # every one, for its term; acted on only by its target
                self.sessions.on_prefetch(cmd)
            elif isinstance(cmd, Fence) and cmd.worker_id == self.worker_id and cmd.epoch >= self.identity.epoch:
                await self._rejoin(cmd.epoch)
            elif isinstance(cmd, Drain) and cmd.worker_id == self.worker_id:
                self.identity.draining = True
                await self.reports.send_heartbeat()

    # -- owners (gateways) ------------------------------------------------------------------

    async def _owners_loop(self) -> None:
        while True:
            for hb in await fetch_decoded(self._owners_in, OwnerHeartbeat):
                self.owners.on_heartbeat(hb)

    async def _owners_probe_loop(self) -> None:
        """Where the owners' topic ends, once per heartbeat interval: the clock their silence
        is judged by (shared/hearing.py)."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            await self.owner_hearing.probe()

    def _cancel_orphaned(self) -> None:
        """Cancel the requests of owners that fell silent: nobody reads their results. Each also
        gets a `Failed` (503), so that a gateway that was only starved tells its client instead
        of waiting for a stream that ended."""
        heard_until = self.owner_hearing.caught_up() if self.owner_hearing is not None else None
        for owner in self.owners.expire(heard_until):
            orphans = self.runner.of_owner(owner)
            log.warning(
                "gateway %s silent for over %.1f s: cancelling its %d requests",
                owner,
                self.settings.worker_timeout_s,
                len(orphans),
            )
            for req in orphans:
                message = f"gateway {owner} was declared lost; the request was cancelled"
                failed = Failed(
                    request_id=req.request_id, attempt=req.attempt, status=503, code="owner_lost", message=message
                )
                self.outbox.put(req.reply_partition, failed)
                self.runner.cancel(req.request_id)  # leaving the engine stream frees its KV

    async def _rejoin(self, fenced: int) -> None:
        """Declared lost at epoch `fenced`: drop that epoch's work and come back at the next."""
        self.runner.fenced_epoch, self.identity.epoch = fenced, fenced + 1
        dropped = self.runner.cancel_all()  # leaving the engine streams aborts them and frees their KV
        log.warning(
            "declared lost at epoch %d: dropping %d requests (re-placed elsewhere), rejoining at epoch %d",
            fenced,
            dropped,
            fenced + 1,
        )
        await self.reports.send_heartbeat()

    # -- heartbeats and telemetry ----------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        """One heartbeat every interval, on the clock: each is sent by a task of its own, so a
        slow acknowledgement does not delay the next beat. Why (issue 22, eleventh session): the
        loop awaited each beat's ack before sleeping again, so on a loaded broker every slow ack
        (seconds at load 40-50) was added to the gap the scheduler judged, and a live worker was
        declared lost. A beat that fails is re-sent by its task (`WorkerReports.send_heartbeat`)."""
        sending: set[asyncio.Task] = set()
        try:
            while True:
                await asyncio.sleep(self.settings.heartbeat_interval_s)
                self._cancel_orphaned()
                task = asyncio.create_task(self.reports.send_heartbeat())
                sending.add(task)
                task.add_done_callback(sending.discard)
        finally:
            for task in sending:
                task.cancel()

    async def _telemetry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.telemetry_interval_s)
            await self.reports.send_telemetry(self.reports.telemetry_report())
