"""The gateway's Kafka side: publishes requests and cancels, routes results to streams, tracks
workers, and heartbeats on `owners` so that, if it dies, the workers cancel its requests."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import zlib

from services.gateway.grants import GrantBook, Slot
from services.gateway.settings import GatewaySettings
from services.gateway.streams import RequestStream, StreamRegistry
from shared.aio import within
from shared.broker_watch import BrokerRestart, BrokerWatch
from shared.kafka import NO_RESEND, KafkaClient, fetch_decoded, with_backoff
from shared.live_workers import LiveWorkers
from shared.metrics import ServiceMetrics
from shared.records import decode_record
from shared.schemas.batches import BatchNotice
from shared.schemas.control import Cancel, ControlEnvelope, Fence
from shared.schemas.grants import PlacementGrant
from shared.schemas.requests import GenerateRequest
from shared.schemas.results import Failed, ResultBatch
from shared.schemas.telemetry import Heartbeat, OwnerHeartbeat
from shared.topics import Topics
from shared.tracing import KafkaHeaders, Tracing, sent_ns

log = logging.getLogger(__name__)
# The stop's bounds (`GatewayCore.stop`): the sends still in flight, then closing the Kafka clients.
STOP_SENDS_GRACE_S = 2.0
STOP_KAFKA_S = 5.0


class GatewayCore:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.gateway_id = settings.gateway_id or f"gw-{socket.gethostname()}-{os.getpid()}"
        self.topics = Topics(settings.topic_prefix)
        partitions = self.topics.results.partitions
        self.reply_partition = (
            settings.reply_partition
            if settings.reply_partition is not None
            else zlib.crc32(self.gateway_id.encode()) % partitions
        )
        self.kafka = KafkaClient(settings, self.gateway_id)
        self.workers = LiveWorkers(settings.worker_timeout_s)
        self.grants = GrantBook(self.workers)  # RT dispatch by grant (grants.py), when `rt_grants`
        self.streams = StreamRegistry(self.submit, self._on_stream_close)
        # granted requests whose flagged copy waits for their first result event (`_hold_copy`)
        self._held_copies: dict[str, tuple[GenerateRequest, KafkaHeaders | None, asyncio.TimerHandle]] = {}
        self._copies_sending: dict[str, asyncio.Task] = {}
        self.metrics = ServiceMetrics("gateway")
        self.m_dispatch = self.metrics.counter(
            "gateway_rt_dispatch_total", "RT requests by path: grant (to the worker) or scheduler", ("path",)
        )
        self.m_granted = self.metrics.gauge("gateway_granted_workers", "workers in the live RT grant")
        self.m_granted.set_function(self.grants.granted_workers)  # read at each scrape: a grant lapses unseen
        self.m_grant_term = self.metrics.gauge("gateway_grant_term", "the scheduler lease term of the RT grant held")
        self.tracing = Tracing("gateway", self.metrics, settings.otlp_endpoint)
        self.broker_watch = BrokerWatch(
            self.kafka, settings.topic_prefix, self._on_broker_restart, interval_s=settings.broker_watch_interval_s
        )
        self._tasks: list[asyncio.Task] = []
        self._fire_and_forget: set[asyncio.Task] = set()
        self.ready = False

    async def start(self) -> None:
        await self.kafka.start(self.topics.static())
        results = await self.kafka.consumer(group=None, hot=True)
        await self.kafka.assign_all(results, self.topics.results.name, from_end=True, partitions=[self.reply_partition])
        heartbeats = await self.kafka.consumer(group=None)
        await self.kafka.assign_all(heartbeats, self.topics.heartbeats.name, from_end=True)
        control = await self.kafka.consumer(group=None)  # fences: a lost worker is not live
        await self.kafka.assign_all(control, self.topics.control.name, from_end=True)
        if self.settings.rt_grants:  # from the end: the active scheduler re-grants every interval
            grants = await self.kafka.consumer(group=None)
            await self.kafka.assign_all(grants, self.topics.placement_grants.name, from_end=True)
            self._tasks.append(asyncio.create_task(self._grants_loop(grants)))
        self._tasks += [
            asyncio.create_task(self._results_loop(results)),
            asyncio.create_task(self._heartbeat_loop(heartbeats)),
            asyncio.create_task(self._fence_loop(control)),
            asyncio.create_task(self._owner_heartbeat_loop()),
        ]
        await self.broker_watch.start()
        self.ready = True
        log.info("gateway %s reading results partition %d", self.gateway_id, self.reply_partition)

    async def stop(self) -> None:
        """Stop, within about `STOP_SENDS_GRACE_S + STOP_KAFKA_S` whatever the broker does.

        A stop often comes with the broker gone: a test run or a benchmark stopped by `timeout`
        takes its broker down with the gateway. Every stream the stop closed then publishes a
        cancel, and each of those sends (and the producer's flush of them) waited out the
        producer's 10 s request timeout on a broker that would never answer; a gateway outlived
        its parent by seconds to minutes while the other services had exited. The cancels are
        a courtesy: a worker cancels the requests of a gateway whose owner heartbeats stop
        (services/worker/owners.py), so those not sent within the grace are dropped (logged)."""
        self.ready = False
        await self.broker_watch.stop()
        for rid in list(self._held_copies):  # sent within the grace below, like the cancels
            self._release_copy(rid)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._drop_unsent(STOP_SENDS_GRACE_S)
        try:
            await within(self.kafka.stop(), STOP_KAFKA_S)
        except TimeoutError:
            log.warning("gateway stop: the Kafka clients did not close within %.0fs; leaving them", STOP_KAFKA_S)
        self.tracing.shutdown()

    async def _drop_unsent(self, grace_s: float) -> None:
        """Give the cancels and batch notices still being sent `grace_s`, then cancel the rest."""
        pending = set(self._fire_and_forget)
        if not pending:
            return
        _, unsent = await asyncio.wait(pending, timeout=grace_s)
        for task in unsent:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if unsent:
            log.warning(
                "gateway stop: dropped %d cancels or notices not sent within %.0fs (the workers cancel "
                "this gateway's requests once its owner heartbeats stop)",
                len(unsent),
                grace_s,
            )

    async def submit(self, request: GenerateRequest, accepted_ns: int | None = None) -> None:
        """Publish a request (a first attempt, or a resumed one); `accepted_ns`: when the HTTP
        handler took it, for the `gateway.accept` hop. An RT request goes straight to a worker
        when the scheduler's grant has a slot for it (grants.py), else to the scheduler."""
        topic = self.topics.rt_requests if request.req_class == "rt" else self.topics.be_requests
        stream = self.streams.get(request.request_id)
        trace = stream.trace if stream is not None else None
        if request.attempt and (request.request_id in self._held_copies or request.request_id in self._copies_sending):
            await self._copy_before_resume(request.request_id)
        slot = self.grants.take(request) if self.settings.rt_grants else None
        send_ns = time.time_ns()
        if slot is not None:
            await self._send_granted(request, slot, Tracing.kafka_headers(trace))
        else:
            await self.kafka.send(topic.name, request, key=request.request_id, headers=Tracing.kafka_headers(trace))
        if request.req_class == "rt":
            self.m_dispatch.labels("grant" if slot is not None else "scheduler").inc()
        # both spans once the request has left: a span costs the loop ~50-120 us (issue 21)
        if accepted_ns is not None:
            self.tracing.hop("gateway.accept", trace, accepted_ns, send_ns)
        self.tracing.hop("gateway.produce", trace, send_ns)
        level = self.broker_watch.recovery.level()  # INFO for a while after a broker restart
        log.log(level, "submitted attempt %d", request.attempt, extra={"request_id": request.request_id})

    async def _send_granted(self, request: GenerateRequest, slot: Slot, headers) -> None:
        """To the granted worker's dispatch topic, and the flagged copy to `requests.rt` (the
        scheduler records the placement from it). Stamped like a scheduler's dispatch, so a fenced
        epoch or a deposed term drops it there (shared/schemas/grants.py).

        `rt_grant_copy_after_ms` 0: both queued at once, one round trip; the dispatch first, so a
        worker never waits on the copy. Above 0: the dispatch alone, and the copy once the
        request's first result event is read, or that many ms after the dispatch's ack, or its
        stream closes, whichever comes first (`_hold_copy`): on a 2-core host the broker and the
        scheduler then handle the copy after the worker's first step, not during it (issue 21,
        twelfth session, docs/services.md)."""
        rid = request.request_id
        granted = request.model_copy(
            update={"worker_epoch": slot.epoch, "scheduler_term": slot.term, "granted_worker": slot.worker_id}
        )
        try:
            dispatch = self.topics.dispatch(slot.worker_id).name
            if self.settings.rt_grant_copy_after_ms > 0:
                await self.kafka.send(dispatch, granted, key=rid, headers=headers)
                self._hold_copy(granted, headers)
                return
            to_worker = await self.kafka.send_nowait(dispatch, granted, key=rid, headers=headers)
            copy = await self.kafka.send_nowait(self.topics.rt_requests.name, granted, key=rid, headers=headers)
            await asyncio.gather(to_worker, copy)
        except BaseException:
            self.grants.release(rid)
            raise

    def _hold_copy(self, granted: GenerateRequest, headers: KafkaHeaders | None) -> None:
        """Hold a granted request's copy until its first result event, its stream's close, or
        `rt_grant_copy_after_ms`, whichever comes first. The failure cases are those of the copy
        sent at once, over a window of at most that bound (docs/services.md, twelfth session):
        the gateway dying before the copy leaves the request to the owner-heartbeat path as
        before; a worker lost meanwhile is fenced before or after the copy arrives, and the
        scheduler re-routes or re-places it either way; a copy arriving after its request
        finished is retired by the worker's next heartbeat (finished ids cover the last minute)."""
        rid = granted.request_id
        # a stream is open here (the dispatch was sent for it); were it closed, the bound sends the copy
        timer = asyncio.get_running_loop().call_later(
            self.settings.rt_grant_copy_after_ms / 1000, self._release_copy, rid
        )
        self._held_copies[rid] = (granted, headers, timer)

    def _release_copy(self, request_id: str) -> None:
        """Send the held copy of `request_id` now, if there is one."""
        held = self._held_copies.pop(request_id, None)
        if held is not None:
            held[2].cancel()
            self._start_copy(held[0], held[1])

    def _start_copy(self, granted: GenerateRequest, headers: KafkaHeaders | None) -> None:
        rid = granted.request_id
        task = asyncio.ensure_future(self._send_copy(granted, headers))
        self._copies_sending[rid] = task
        self._fire_and_forget.add(task)

        def done(t: asyncio.Task) -> None:
            self._fire_and_forget.discard(t)
            if self._copies_sending.get(rid) is t:
                del self._copies_sending[rid]

        task.add_done_callback(done)

    async def _send_copy(self, granted: GenerateRequest, headers: KafkaHeaders | None) -> None:
        """The copy must reach the scheduler while its request may still need re-placing: a
        broker briefly away is waited out (about a minute), like a service's start."""
        rid = granted.request_id
        try:
            await with_backoff(
                f"granted copy of {rid}",
                lambda: self.kafka.send(self.topics.rt_requests.name, granted, key=rid, headers=headers),
            )
        except Exception:  # noqa: BLE001
            log.warning(
                "granted copy not published: the scheduler does not know this request",
                exc_info=True,
                extra={"request_id": rid},
            )

    async def _copy_before_resume(self, request_id: str) -> None:
        """A resumed attempt of a granted request (a gap in its stream) must follow the first
        attempt's copy on `requests.rt` (same key, same partition): the scheduler's assignment
        table keeps one entry per request id, and a late copy of attempt 0 would replace the
        resumed attempt's."""
        self._release_copy(request_id)
        task = self._copies_sending.get(request_id)
        if task is not None:
            await asyncio.shield(task)

    def _on_stream_close(self, request_id: str) -> None:
        self.grants.release(request_id)
        self._release_copy(request_id)

    def _on_first_events(self, batch: ResultBatch) -> None:
        """Release the held copies of requests that have a result event now (not an `Accepted`
        alone: a first token, a failure, a re-route)."""
        for e in batch.events:
            if e.request_id in self._held_copies and e.type != "accepted":
                self._release_copy(e.request_id)

    async def _grants_loop(self, consumer) -> None:
        known: set[str] = set()
        while True:
            for grant in await fetch_decoded(consumer, PlacementGrant):
                if not self.grants.on_grant(grant):
                    continue
                self.m_grant_term.set(grant.term)
                for g in grant.workers:
                    if g.worker_id not in known:  # its topic's metadata now, not on the first request's path
                        known.add(g.worker_id)
                        dispatch = self.topics.dispatch(g.worker_id)
                        self.kafka.remember(dispatch)  # one partition: sent to 0 even after a broker restart
                        await self._warm(dispatch.name)

    async def _warm(self, topic: str) -> None:
        try:
            await within(self.kafka.producer.partitions_for(topic), 5.0)
        except Exception:  # noqa: BLE001 (the first granted send fetches it instead)
            log.warning("no metadata for %s yet", topic, exc_info=True)

    def cancel_soon(self, request_id: str) -> None:
        """Publish a cancel without awaiting it (called from cleanup paths that may be cancelled)."""
        task = asyncio.ensure_future(self._cancel(request_id))
        self._fire_and_forget.add(task)
        task.add_done_callback(self._fire_and_forget.discard)

    def notify_batch(self, batch_id: str, change: str) -> None:
        """Tell the queue service a batch was created or cancelled, so it acts now rather than at
        its safety poll (shared/schemas/batches.py). Not awaited: the row is already written,
        and a lost notice only delays the batch."""
        task = asyncio.ensure_future(self._notify_batch(BatchNotice(batch_id=batch_id, change=change)))
        self._fire_and_forget.add(task)
        task.add_done_callback(self._fire_and_forget.discard)

    async def _notify_batch(self, notice: BatchNotice) -> None:
        try:
            await self.kafka.send(self.topics.batches.name, notice, key=notice.batch_id)
        except Exception:  # noqa: BLE001
            log.warning("batch notice for %s not published", notice.batch_id, exc_info=True)

    async def _cancel(self, request_id: str) -> None:
        try:
            await self.kafka.send(
                self.topics.control.name, ControlEnvelope(message=Cancel(request_id=request_id)), key=request_id
            )
        except Exception:  # noqa: BLE001
            log.warning("cancel not published", exc_info=True, extra={"request_id": request_id})

    async def _results_loop(self, consumer) -> None:
        while True:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                read_ns = time.time_ns()
                for record in records:
                    batch = decode_record(ResultBatch, record)
                    if batch is None:
                        continue  # malformed: logged and skipped
                    if log.isEnabledFor(logging.DEBUG):
                        for e in batch.events:
                            log.debug("event %s", e.type, extra={"request_id": e.request_id})
                    await self.route(batch, sent_ns(record.headers), read_ns)

    async def route(self, batch: ResultBatch, sent: int | None = None, read_ns: int = 0) -> None:
        """Hand `batch`'s events to their streams, then release the held copies they concern
        (after: the first token's SSE write is queued before the copy's send)."""
        await self.streams.on_batch(batch, sent, read_ns)
        if self._held_copies:
            self._on_first_events(batch)

    async def _heartbeat_loop(self, consumer) -> None:
        while True:
            for hb in await fetch_decoded(consumer, Heartbeat):
                self.workers.on_heartbeat(hb)

    async def _owner_heartbeat_loop(self) -> None:
        started_at = time.time()
        while True:
            hb = OwnerHeartbeat(owner_id=self.gateway_id, started_at=started_at, sent_at=time.time())
            try:
                await self.kafka.send(self.topics.owners.name, hb, key=self.gateway_id, resend=NO_RESEND)
            except Exception:  # noqa: BLE001 (the broker may be briefly away; the next beat retries)
                log.warning("owner heartbeat not sent", exc_info=True)
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def _fence_loop(self, consumer) -> None:
        while True:
            for envelope in await fetch_decoded(consumer, ControlEnvelope):
                if isinstance(envelope.message, Fence):
                    self.workers.on_fence(envelope.message.worker_id, envelope.message.epoch)

    async def _on_broker_restart(self, restart: BrokerRestart) -> None:
        """The broker lost its data: the results of every open stream are gone with it. Each
        stream ends now with 503 `broker_restarted` (the client may retry at once; a new request
        is served) rather than hanging until its timeout, and its request is cancelled on its
        worker so its KV is freed. A stream opened after the restart but before this check is
        ended too: we cannot tell it apart, and a clear error is better than a possible hang."""

        def failure(stream: RequestStream) -> Failed:
            return Failed(
                request_id=stream.request.request_id,
                attempt=stream.attempt,
                status=503,
                code="broker_restarted",
                message="the message broker restarted and this request's results were lost; retry it",
            )

        self.grants.clear()  # its scheduler's term and workers' epochs belong to the lost broker
        for _, _, timer in self._held_copies.values():  # their worker's epochs died with the broker too
            timer.cancel()
        self._held_copies.clear()
        ended = self.streams.fail_open(failure)
        for request_id in ended:
            self.cancel_soon(request_id)
        log.warning("broker restarted: ended %d open streams with 503 broker_restarted", len(ended))
