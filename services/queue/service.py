"""The queue service: turns batch jobs into BE requests and their results into output files.

When something happens (a batch created or cancelled, an item finished, more BE capacity while
items wait), at a batch's expiry, or every `idle_tick_s` as a safety net (`wakeup.py`), it
validates new batches, handles cancels and expiry, releases queued items while fewer than the
scheduler's published BE capacity are in flight, and finalises batches whose items are all
done. Results come back on its own results partition, like a gateway's; each item's events are
assembled in memory and its outcome recorded once in the database. Nothing that matters lives
only in memory: after a crash, items that were in flight are queued again as a new attempt (a
late result of the old attempt is ignored), so every custom_id ends with exactly one result.

Two queue services may run at once: one active, one standby (`services/standby.py`). The
standby waits; taking over is the restart above (items in flight re-queued as new attempts),
so whatever a deposed active still releases or records is of an attempt the database no longer
accepts. The active ticks only while its lease holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib

from services.queue.items import ItemRun, item_request, item_request_id, unfinished_line
from services.queue.settings import QueueSettings
from services.queue.validation import validate_input
from services.queue.wakeup import TickClock
from services.standby import ActiveStandby
from shared.batchstore.db import BatchDatabase, BatchRow, ItemRow, now
from shared.batchstore.objects import errors_object
from shared.batchstore.run_store import BatchRunStore, Finished
from shared.broker_watch import BrokerRestart, BrokerWatch
from shared.fence_feed import follow_fences
from shared.kafka import KafkaClient, fetch_decoded
from shared.live_workers import LiveWorkers
from shared.metrics import ServiceMetrics
from shared.openai_api.translate import ReplyTo
from shared.schemas.batches import BatchNotice
from shared.schemas.capacity import BECapacity
from shared.schemas.control import Cancel, ControlEnvelope
from shared.schemas.results import Delta, Rerouted, ResultBatch
from shared.schemas.telemetry import Heartbeat
from shared.topics import Topics

log = logging.getLogger(__name__)


class QueueService:
    def __init__(self, settings: QueueSettings) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.queue_id = settings.queue_id
        partitions = self.topics.results.partitions
        self.partition = (
            settings.queue_reply_partition
            if settings.queue_reply_partition is not None
            else zlib.crc32(self.queue_id.encode()) % partitions
        )
        self.reply_to = ReplyTo(self.queue_id, self.partition)  # where its items' results come back
        self.kafka = KafkaClient(settings, self.queue_id)
        self.db = BatchDatabase(settings.resolved_database_url())
        self.store = BatchRunStore(self.db)
        self.workers = LiveWorkers(settings.worker_timeout_s)
        self.runs: dict[str, ItemRun] = {}  # request id -> item in flight
        self.capacity: BECapacity | None = None
        self.capacity_seen = 0.0  # monotonic time of the last report
        self.started = time.monotonic()
        self.clock = TickClock(settings.idle_tick_s)
        self._may_have_queued = True  # items may wait for budget (cleared when a claim comes up short)
        self._tasks: list[asyncio.Task] = []
        self.broker_watch = BrokerWatch(
            self.kafka, settings.topic_prefix, self._on_broker_restart, interval_s=settings.broker_watch_interval_s
        )
        self.lease = ActiveStandby(self.kafka, self.topics.leases.name, "queue", self.queue_id, settings.lease_s)
        self._init_metrics()

    def _init_metrics(self) -> None:
        m = self.metrics = ServiceMetrics("queue")
        self.m_in_flight = m.gauge("queue_items_in_flight", "batch items released and not finished")
        self.m_budget = m.gauge("queue_be_budget", "BE items the scheduler says the workers can hold")
        self.m_finished = m.counter("queue_items_finished_total", "batch items finished", ("outcome",))
        self.m_rerun = m.counter("queue_items_rerun_total", "items re-run after a worker loss")
        self.m_batches = m.counter("queue_batches_total", "batches that reached a final status", ("status",))

    # -- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        await self.db.start()
        await self.kafka.start(self.topics.static())
        self.metrics.serve(self.settings.metrics_port)
        # Standby too: the watch is what rewinds the lease reader onto a restarted broker's new
        # `leases` topic. A standby without one kept its old position, above the new topic's end,
        # read nothing more, claimed the next term every tick and never read its claim back, while
        # the active read that claim and exited deposed: no queue was active (`tandem chaos --ha`).
        await self.broker_watch.start()
        await self.lease.start(self._activate)

    async def _activate(self, term: int) -> None:
        """Holding the lease: re-queue what the last active had in flight, then run."""
        requeued = await self.store.requeue_in_flight()
        if requeued:
            log.info("re-queued %d items that were in flight before the restart", requeued)
        results = await self._tail(self.topics.results.name, hot=True, partitions=[self.partition])
        heartbeats = await self._tail(self.topics.heartbeats.name)
        capacity = await self._tail(self.topics.be_capacity.name)
        notices = await self._tail(self.topics.batches.name)
        self.started = time.monotonic()
        loops = (
            self._results_loop(results),
            self._heartbeat_loop(heartbeats),
            follow_fences(self.kafka, self.topics.scheduler_fences.name, self.workers),
            self._capacity_loop(capacity),
            self._notice_loop(notices),
            self._tick_loop(),
        )
        self._tasks = [asyncio.create_task(c) for c in loops]
        log.info("queue %s reading results partition %d", self.queue_id, self.partition)

    async def _tail(self, topic: str, hot: bool = False, partitions: list[int] | None = None):
        c = await self.kafka.consumer(group=None, hot=hot)
        await self.kafka.assign_all(c, topic, from_end=True, partitions=partitions)
        return c

    async def stop(self) -> None:
        await self.broker_watch.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.lease.stop()
        await self.kafka.stop()
        await self.db.close()

    async def _on_broker_restart(self, restart: BrokerRestart) -> None:
        """The broker lost its data: the requests of the items in flight and their results may be
        gone. The database is the source of truth: every item it has in flight is queued again as
        a new attempt (released at the next tick), exactly as after the queue's own restart; a
        late result of an old attempt is ignored, so each item still ends with one result. Old
        attempts still running on workers run out unread (their work is wasted, not doubled).
        A standby has nothing in flight, and must not re-queue the active's items: the repair
        (its lease reader rewound) is all it needs."""
        self.lease.broker_restarted()  # terms start again on the new `leases` topic, standby too
        if not self.lease.term:
            log.warning("broker restarted while standing by: topics repaired, lease reader rewound")
            return
        self.runs.clear()
        requeued = await self._db(self.store.requeue_in_flight)
        self.m_in_flight.set(0)
        self.capacity = None  # wait for the scheduler's next report on the new broker
        log.warning("broker restarted: re-queued %d in-flight items as new attempts", requeued)
        self.clock.wake()

    # -- inputs ----------------------------------------------------------------------------

    async def _heartbeat_loop(self, consumer) -> None:
        while True:
            for hb in await fetch_decoded(consumer, Heartbeat):
                self.workers.on_heartbeat(hb)

    async def _capacity_loop(self, consumer) -> None:
        while True:
            reports = await fetch_decoded(consumer, BECapacity)
            if reports:
                self.capacity, self.capacity_seen = reports[-1], time.monotonic()
                self.m_budget.set(self.capacity.slots)
                if self._may_have_queued and self.budget() > len(self.runs):
                    self.clock.wake()  # room for items that wait; otherwise the report changes nothing

    async def _notice_loop(self, consumer) -> None:
        """The gateway created or cancelled a batch: run the work loop now."""
        while True:
            if await fetch_decoded(consumer, BatchNotice):
                self.clock.wake()

    def budget(self) -> int:
        """Items that may be in flight now: the scheduler's BE slots, or 0 when it has gone quiet."""
        fresh = time.monotonic() - self.capacity_seen <= self.settings.capacity_stale_s
        return self.capacity.slots if self.capacity is not None and fresh else 0

    async def _results_loop(self, consumer) -> None:
        while True:
            finished: list[ItemRun] = []
            for batch in await fetch_decoded(consumer, ResultBatch):
                finished.extend(await self._on_events(batch))
            if finished:
                await self._record(finished)

    async def _on_events(self, batch: ResultBatch) -> list[ItemRun]:
        finished = []
        for event in batch.events:
            run = self.runs.get(event.request_id)
            if run is None or run.finished or event.attempt != run.request.attempt:
                continue  # not ours, already done, or a stale attempt
            if isinstance(event, Rerouted):
                await self._rerun(run, event.reason)
                continue
            if isinstance(event, Delta) and event.index > len(run.token_ids):
                # Deltas between were lost (a produce the broker refused, or re-sent after later
                # ones: shared/produce_resend.py); as the gateway resumes a stream, run it again.
                await self._rerun(run, f"delta gap: have {len(run.token_ids)}, got {event.index}")
                continue
            run.apply(event)
            if run.finished:
                finished.append(run)
        return finished

    async def _rerun(self, run: ItemRun, reason: str) -> None:
        """Its worker was lost, or its results have a gap: run the item again from scratch as the
        next attempt (a worker still running the old one cancels it for the new one)."""
        attempt = run.request.attempt
        rid = run.request.request_id
        if not self.lease.is_active():
            return  # deposed: the new active re-queued this item at takeover
        if not await self._db(self.store.bump_attempt, run.batch_id, run.custom_id, attempt):
            self.runs.pop(rid, None)  # cancelled or expired meanwhile
            return
        run.restart(run.request.model_copy(update={"attempt": attempt + 1, "created_at": time.time()}))
        self.m_rerun.inc()
        log.warning("re-running as attempt %d: %s", attempt + 1, reason, extra={"request_id": rid})
        await self.kafka.send(self.topics.be_requests.name, run.request, key=rid)

    async def _record(self, runs: list[ItemRun]) -> None:
        results = [Finished(r.batch_id, r.custom_id, r.request.attempt, r.succeeded, r.output_line()) for r in runs]
        recorded = await self._db(self.store.record, results)
        for r in runs:
            self.runs.pop(r.request.request_id, None)
        for r in recorded:
            self.m_finished.labels("completed" if r.succeeded else "failed").inc()
        self.m_in_flight.set(len(self.runs))
        self.clock.wake()

    async def _db(self, fn, *args, attempts: int = 5):
        """A database call, retried a few times (a busy SQLite file, a PostgreSQL restart)."""
        for i in range(attempts):
            try:
                return await fn(*args)
            except Exception:  # noqa: BLE001
                if i == attempts - 1:
                    raise
                log.warning("database call failed; retrying", exc_info=True)
                await asyncio.sleep(0.5 * (i + 1))
        raise AssertionError("unreachable")

    # -- the periodic work -------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        while True:
            await self.clock.wait()
            if not self.lease.is_active():
                # the lease lapsed (a long pause): nothing is released until it is renewed;
                # look again soon rather than at the next event
                self.clock.wake_at(time.time() + 0.5)
                continue
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 (the database or broker hiccuped: retry soon)
                log.exception("queue tick failed")
                self.clock.wake_at(time.time() + 1.0)

    async def tick(self) -> None:
        self.clock.clear_deadlines()  # each step below sets the deadlines it still has
        await self._validate_new()
        await self._handle_cancels()
        await self._expire()
        await self._release()
        await self._finalize_done()

    async def _validate_new(self) -> None:
        for batch in await self.store.batches_in("validating"):
            wait_s = self.settings.worker_timeout_s - (time.monotonic() - self.started)
            if wait_s > 0:
                self.clock.wake_at(time.time() + wait_s)
                return  # learn which models the live workers serve first
            await self._validate(batch)

    async def _validate(self, batch: BatchRow) -> None:
        content = await self.store.input_content(batch.input_file_id)
        if content is None:
            errors = [
                {
                    "code": "file_not_found",
                    "message": f"input file {batch.input_file_id} no longer exists",
                    "param": "input_file_id",
                    "line": None,
                }
            ]
            await self.store.fail_validation(batch.id, errors_object(errors, 1))
            return
        models = set(self.workers.models()) or None  # no live worker: the model cannot be checked yet
        s = self.settings
        v = await asyncio.to_thread(
            validate_input,
            content,
            batch.endpoint,
            max_lines=s.max_batch_lines,
            max_errors=s.max_batch_errors,
            models=models,
        )
        if v.error_count:
            await self.store.fail_validation(batch.id, errors_object(v.errors, v.error_count))
            self.m_batches.labels("failed").inc()
            log.info("batch %s failed validation with %d errors", batch.id, v.error_count)
            return
        ids = [item_request_id(batch.id, ln.line) for ln in v.lines]
        if await self.store.start_batch(batch, v.lines, ids):
            self._may_have_queued = True
            log.info("batch %s in progress: %d items", batch.id, len(v.lines))

    async def _handle_cancels(self) -> None:
        for batch in await self.store.batches_in("cancelling"):
            await self._stop_items(batch, "cancelled")
            await self._finish(batch, "cancelling", "cancelled", cancelled_at=now())

    async def _expire(self) -> None:
        t = now()
        for batch in await self.store.batches_in("validating", "in_progress"):
            if t >= batch.expires_at:
                await self._stop_items(batch, "expired")
                await self._finish(batch, batch.status, "expired", expired_at=t)
            else:  # `now()` is whole seconds: wake just past the second it expires in
                self.clock.wake_at(batch.expires_at + 0.01)

    async def _stop_items(self, batch: BatchRow, status: str) -> None:
        """Stop releasing the batch's items and end those in flight on their workers."""
        for rid in await self.store.stop_items(batch.id, status):
            self.runs.pop(rid, None)
            await self.kafka.send(self.topics.control.name, ControlEnvelope(message=Cancel(request_id=rid)), key=rid)
        self.m_in_flight.set(len(self.runs))

    async def _release(self) -> None:
        room = self.budget() - len(self.runs)
        claimed = await self.store.claim(room)
        if room > 0:
            self._may_have_queued = len(claimed) == room  # fewer: nothing else is queued now
        acks = []
        for c in claimed:
            item = c.item
            body = json.loads(item.body_json)
            req = item_request(
                c.endpoint,
                body,
                request_id=item.request_id,
                attempt=item.attempt,
                reply_to=self.reply_to,
                batch_id=item.batch_id,
                custom_id=item.custom_id,
                cache_salt=c.cache_salt,
            )
            self.runs[req.request_id] = ItemRun(item.batch_id, item.custom_id, req, body.get("service_tier"))
            acks.append((item, await self.kafka.send_nowait(self.topics.be_requests.name, req, key=req.request_id)))
        for item, ack in acks:
            try:
                await ack
            except Exception:  # noqa: BLE001 (not published: queue it again as a new attempt)
                log.warning("release failed; re-queued", exc_info=True, extra={"request_id": item.request_id})
                self.runs.pop(item.request_id, None)
                await self.store.requeue(item.batch_id, item.custom_id, item.attempt)
                self._may_have_queued = True
        self.m_in_flight.set(len(self.runs))

    async def _finalize_done(self) -> None:
        for batch in await self.store.batches_in("in_progress", "finalizing"):
            if batch.status == "in_progress":
                if batch.completed + batch.failed < batch.total:
                    continue
                await self.store.move(batch.id, "in_progress", "finalizing", finalizing_at=now())
            await self._finish(batch, "finalizing", "completed", completed_at=now())

    async def _finish(self, batch: BatchRow, old: str, new: str, **values) -> None:
        items = await self.store.items_of(batch.id)
        outputs = _output_files(items)
        if await self.store.finish_batch(batch.id, old, new, outputs, **values):
            self.m_batches.labels(new).inc()
            log.info("batch %s %s (%d items)", batch.id, new, len(items))


_UNFINISHED = {
    "cancelled": ("batch_cancelled", "the batch was cancelled before this request finished"),
    "expired": ("batch_expired", "the batch expired before this request finished"),
}


def _output_files(items: list[ItemRow]) -> dict[str, bytes]:
    out, err = [], []
    for item in items:
        if item.status == "done":
            out.append(item.result_json)
        elif item.status == "failed":
            err.append(item.result_json)
        elif item.status in _UNFINISHED:
            code, message = _UNFINISHED[item.status]
            err.append(json.dumps(unfinished_line(item.request_id, item.custom_id, code, message)))
    files = {}
    if out:
        files["output"] = ("\n".join(out) + "\n").encode()
    if err:
        files["error"] = ("\n".join(err) + "\n").encode()
    return files
