"""The worker service: one engine per process, fed by its dispatch topic.

Tasks: read dispatch (one stream task per request), read control (cancel, drain, fence), read
the owners' (gateways') heartbeats and cancel a dead owner's requests (owners.py), publish
heartbeats and telemetry. Token deltas leave through `ResultOutbox`, one message per gateway
partition per engine step. A request is keyed "request_id:attempt" so a re-delivered dispatch
(consumer restart) is applied once and a resumed attempt never collides with a stale one.

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
from collections import OrderedDict, deque
from dataclasses import dataclass, replace

from aiokafka import AIOKafkaConsumer
from opentelemetry.context import Context

from engine.async_llm import AsyncLLM, RequestStream
from services.worker.adapter import EngineRequest, to_engine_request
from services.worker.outbox import ResultOutbox
from services.worker.owners import OwnerWatch
from services.worker.sessions import WorkerSessions
from services.worker.settings import WorkerSettings
from services.worker.telemetry import TelemetryWindow, request_timing
from shared.broker_watch import BrokerRestart, BrokerWatch
from shared.kafka import KafkaClient, fetch_decoded
from shared.metrics import ServiceMetrics
from shared.records import decode_record
from shared.schemas.control import Cancel, ControlEnvelope, Drain, Fence, Prefetch
from shared.schemas.requests import GenerateRequest
from shared.schemas.results import Accepted, Delta, Failed
from shared.schemas.telemetry import Heartbeat, OwnerHeartbeat
from shared.topics import Topics
from shared.tracing import Tracing, context_of, sent_ns

log = logging.getLogger(__name__)


@dataclass
class _Trace:
    """A dispatched request's trace context and the worker-side times its hop spans start from."""

    context: Context | None
    read_ns: int  # the worker read the dispatch record
    queued_ns: int = 0  # the engine queued it


_SEEN_LIMIT = 100_000  # dispatch keys remembered for de-duplication
_FINISHED_WINDOW_S = 60.0


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
        self.model_name = served_name(settings)
        self.topics = Topics(settings.topic_prefix)
        self.kafka = KafkaClient(settings, f"worker-{self.worker_id}")
        self.session_dir = settings.resolved_session_dir(self.worker_id)
        self.llm = AsyncLLM(settings.engine_config(self.session_dir))
        self.outbox = ResultOutbox(self.kafka, self.topics.results.name, self.worker_id)
        self.sessions = WorkerSessions(
            self.llm, self.kafka, self.topics.sessions_directory.name, self.worker_id, settings, self.session_dir
        )
        self.telemetry = TelemetryWindow()
        self.draining = False
        self.started_at = time.time()
        self.epoch = int(self.started_at * 1000)  # raised past each fence (re-admission)
        self.fenced_epoch = -1  # the highest epoch of ours the scheduler declared lost
        self.scheduler_term = 0  # the highest scheduler lease term seen on a dispatch (older ones are dropped)
        self._tasks: dict[str, asyncio.Task] = {}  # request_id -> its stream task
        self._requests: dict[str, GenerateRequest] = {}  # request_id -> the attempt that task serves
        self.owners = OwnerWatch(settings.worker_timeout_s)
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._finished: deque[tuple[float, str]] = deque()
        self._background: list[asyncio.Task] = []
        # After a broker restart a worker needs the repair (its dispatch topic recreated with one
        # partition, its readers rewound) and to forget its term floors: what it runs belongs to
        # owners that react themselves.
        self.broker_watch = BrokerWatch(
            self.kafka, settings.topic_prefix, self._on_broker_restart, interval_s=settings.broker_watch_interval_s
        )
        self._init_metrics()

    async def _on_broker_restart(self, restart: BrokerRestart) -> None:
        """Lease terms are counted on the broker's `leases` topic, which a restart empties: a
        scheduler or advisory service started after it claims term 1 again, and a floor kept
        from before would drop all its dispatches and prefetches (broker + scheduler never
        recovered that way, `tandem chaos`). A surviving active renews at its own term, which
        sets the floor again at once."""
        self.scheduler_term = 0
        self.sessions.advisory_term = 0

    def _init_metrics(self) -> None:
        m = self.metrics = ServiceMetrics("worker")
        self.tracing = Tracing("worker", self.metrics, self.settings.otlp_endpoint)
        self.m_load = m.gauge("worker_requests", "requests in the engine", ("req_class", "state"))
        self.m_kv = m.gauge("worker_kv_usage", "fraction of KV blocks in use")
        self.m_tokens = m.counter("worker_output_tokens_total", "tokens generated")
        self.m_ttft = m.histogram("worker_ttft_seconds", "engine time to first token", ("req_class",))
        self.m_tpot = m.histogram("worker_tpot_seconds", "engine time per output token", ("req_class",))
        self.m_class_tokens = m.counter("worker_generated_tokens_total", "tokens generated, by class", ("req_class",))
        self.m_slo = m.counter(
            "worker_slo_requests_total",
            "finished requests that had an SLO, by whether it was met",
            ("req_class", "met"),
        )

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
        self._control = await self.kafka.consumer(group=None)
        await self.kafka.assign_all(self._control, self.topics.control.name, from_end=True)
        self._owners_in = await self.kafka.consumer(group=None)
        await self.kafka.assign_all(self._owners_in, self.topics.owners.name, from_end=True)
        loops = (
            self._dispatch_loop(),
            self._control_loop(),
            self._owners_loop(),
            self._heartbeat_loop(),
            self._telemetry_loop(),
        )
        self._background = [asyncio.create_task(c) for c in loops]
        await self._send_heartbeat()
        await self.broker_watch.start()
        self.metrics.serve(self.settings.metrics_port)
        log.info(
            "worker %s serving %r (dispatch topic %s; consuming %.2fs after the model was loaded)",
            self.worker_id,
            self.model_name,
            dispatch.name,
            time.monotonic() - loaded,
        )

    async def stop(self) -> None:
        """Drain: stop taking work, let running requests finish (bounded), flush, close."""
        self.draining = True
        if self._background:  # it served (a stop during start has no engine info to announce)
            await self._send_heartbeat()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=self.settings.drain_timeout_s)
        for t in [*self._tasks.values(), *self._background]:
            t.cancel()
        await asyncio.gather(*self._tasks.values(), *self._background, return_exceptions=True)
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
                    self._accept(msg)
            if batches:
                await consumer.commit()  # accepted into the engine: a redelivery would be a duplicate

    def _accept(self, record) -> None:
        read_ns = time.time_ns()
        req = decode_record(GenerateRequest, record)
        if req is None:
            return  # malformed: logged and skipped
        hop = _Trace(context_of(record.headers), read_ns)
        sent = sent_ns(record.headers)
        if sent is not None:
            self.tracing.hop("worker.consume", hop.context, sent, read_ns)
        key = f"{req.request_id}:{req.attempt}"
        log.debug("dispatch received", extra={"request_id": req.request_id})
        if req.scheduler_term is not None:  # a deposed scheduler's late dispatch: its successor placed it
            if req.scheduler_term < self.scheduler_term:
                log.info("dropped: dispatched at stale scheduler term %d", req.scheduler_term)
                return
            self.scheduler_term = req.scheduler_term
        if req.worker_epoch is not None and req.worker_epoch <= self.fenced_epoch:
            log.info("dropped: dispatched to fenced epoch %d", req.worker_epoch, extra={"request_id": req.request_id})
            return  # the scheduler re-placed it when it fenced that epoch
        if self.owners.is_dead(req.gateway_id):
            log.info("dropped: its gateway %s is gone", req.gateway_id, extra={"request_id": req.request_id})
            self._finished.append((time.monotonic(), key))  # done, as far as the scheduler is concerned
            return
        if key in self._seen:
            return
        self._remember(key)
        old = self._tasks.get(req.request_id)
        if old is not None:
            old.cancel()  # an older attempt of the same request still here: the new one wins
        self._tasks[req.request_id] = asyncio.create_task(self._serve(req, hop), name=key)
        self._requests[req.request_id] = req

    def _remember(self, key: str) -> None:
        self._seen[key] = None
        while len(self._seen) > _SEEN_LIMIT:
            self._seen.popitem(last=False)

    async def _serve(self, req: GenerateRequest, hop: _Trace | None = None) -> None:
        hop = hop or _Trace(None, time.time_ns())
        try:
            try:
                er = to_engine_request(req, self.llm.info.max_model_len)
                if req.session_id is not None and self.sessions.must_prepare(req):
                    stream = await self._enter_after_prepare(req, er)
                else:
                    stream = await self._enter(er, req)
                    self._accepted(req, stream.num_prompt_tokens)
                hop.queued_ns = time.time_ns()
                self.tracing.hop("worker.engine_queue", hop.context, hop.read_ns, hop.queued_ns)
            except ValueError as exc:
                failed = Failed(request_id=req.request_id, attempt=req.attempt, message=str(exc))
                self.outbox.put(req.reply_partition, failed)
                return
            try:
                await self._stream(req, er, stream, hop)
            finally:
                stream.close()  # before the last delta (cancelled): aborts the request, frees its KV
        finally:
            self._forget(req)

    async def _enter(self, er: EngineRequest, req: GenerateRequest) -> RequestStream:
        """Into the engine: tokenized, validated and queued on the engine thread in one hop."""
        return await self.llm.add_request(
            er.key,
            er.prompt,
            er.params,
            req_class=er.req_class,
            slo=er.slo,
            resumed_output_ids=er.resumed_output_ids,
            session_id=req.session_id,
            cache_salt=req.cache_salt,
        )

    async def _enter_after_prepare(self, req: GenerateRequest, er: EngineRequest) -> RequestStream:
        """A session turn that must wait for (or decide on) a KV pull before it enters the engine:
        checked first, so a bad request fails before any transfer and the pull decision knows the
        prompt's length; accepted; prepared; then added. One more engine hop than `_enter`, on a
        turn that is about to pull KV or recompute its history anyway."""
        checked = await self.llm.check(er.prompt, er.params, er.resumed_output_ids)
        self._accepted(req, len(checked.prompt_token_ids))
        await self.sessions.prepare(req, len(checked.prompt_token_ids))
        return await self._enter(replace(er, prompt=checked.prompt_token_ids, params=checked.params), req)

    def _accepted(self, req: GenerateRequest, prompt_tokens: int) -> None:
        self.outbox.put(
            req.reply_partition,
            Accepted(
                request_id=req.request_id,
                attempt=req.attempt,
                worker_id=self.worker_id,
                prompt_tokens=prompt_tokens,
            ),
        )

    async def _stream(self, req: GenerateRequest, er: EngineRequest, stream: RequestStream, hop: _Trace) -> None:
        index = len(er.resumed_output_ids)
        async for d in stream:
            on_ack = None
            if index == len(er.resumed_output_ids):
                log.debug("first delta", extra={"request_id": req.request_id})
                first_ns = time.time_ns()
                self.tracing.hop("worker.first_token", hop.context, hop.queued_ns, first_ns)
                on_ack = lambda: self.tracing.hop("worker.result_produce", hop.context, first_ns)  # noqa: B023, E731
            self.telemetry.add_tokens(len(d.token_ids))
            final = d.metrics
            self.outbox.put(
                req.reply_partition,
                Delta(
                    request_id=req.request_id,
                    attempt=req.attempt,
                    index=index,
                    token_ids=d.token_ids,
                    text=d.text,
                    logprobs=d.logprobs,
                    finish_reason=d.finish_reason,
                    token_texts=d.token_texts,
                    prompt_tokens=stream.num_prompt_tokens if d.finished else None,
                    cached_tokens=final.num_cached_tokens if final else None,
                ),
                on_ack,
            )
            index += len(d.token_ids)
            if final is not None:
                self.telemetry.finished(request_timing(req.request_id, er.req_class, er.slo, final))

    def _forget(self, req: GenerateRequest) -> None:
        if self._tasks.get(req.request_id) is asyncio.current_task():
            del self._tasks[req.request_id]
            del self._requests[req.request_id]
        self._finished.append((time.monotonic(), f"{req.request_id}:{req.attempt}"))

    # -- control -------------------------------------------------------------------------

    async def _control_loop(self) -> None:
        while True:
            envelope = decode_record(ControlEnvelope, await self._control.getone())
            if envelope is None:
                continue  # malformed: logged and skipped
            cmd = envelope.message
            if isinstance(cmd, Cancel):
                task = self._tasks.get(cmd.request_id)
                if task is not None:
                    task.cancel()  # leaving the engine stream aborts the request and frees its KV
                    log.info("cancelled", extra={"request_id": cmd.request_id})
            elif isinstance(cmd, Prefetch):  # every one, for its term; acted on only by its target
                self.sessions.on_prefetch(cmd)
            elif isinstance(cmd, Fence) and cmd.worker_id == self.worker_id and cmd.epoch >= self.epoch:
                await self._rejoin(cmd.epoch)
            elif isinstance(cmd, Drain) and cmd.worker_id == self.worker_id:
                self.draining = True
                await self._send_heartbeat()

    # -- owners (gateways) ------------------------------------------------------------------

    async def _owners_loop(self) -> None:
        while True:
            for hb in await fetch_decoded(self._owners_in, OwnerHeartbeat):
                self.owners.on_heartbeat(hb)

    def _cancel_orphaned(self) -> None:
        """Cancel the requests of owners that fell silent: nobody reads their results. Each also
        gets a `Failed` (503), so that a gateway that was only starved tells its client instead
        of waiting for a stream that ended."""
        for owner in self.owners.expire():
            orphans = [r for r in self._requests.values() if r.gateway_id == owner]
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
                self._tasks[req.request_id].cancel()  # leaving the engine stream frees its KV

    async def _rejoin(self, fenced: int) -> None:
        """Declared lost at epoch `fenced`: drop that epoch's work and come back at the next."""
        stale = list(self._tasks.values())
        log.warning(
            "declared lost at epoch %d: dropping %d requests (re-placed elsewhere), rejoining at epoch %d",
            fenced,
            len(stale),
            fenced + 1,
        )
        self.fenced_epoch, self.epoch = fenced, fenced + 1
        for task in stale:
            task.cancel()  # leaving the engine stream aborts the request and frees its KV
        await self._send_heartbeat()

    # -- heartbeats and telemetry ----------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            self._cancel_orphaned()
            await self._send_heartbeat()

    async def _send_heartbeat(self) -> None:
        now = time.monotonic()
        while self._finished and self._finished[0][0] < now - _FINISHED_WINDOW_S:
            self._finished.popleft()
        running = [t.get_name() for t in self._tasks.values()]
        info = self.llm.info
        hb = Heartbeat(
            worker_id=self.worker_id,
            model=self.model_name,
            max_model_len=info.max_model_len,
            dtype=info.dtype,
            device=info.device,
            dispatch_topic=self.topics.dispatch(self.worker_id).name,
            started_at=self.started_at,
            sent_at=time.time(),
            epoch=self.epoch,
            draining=self.draining,
            running_ids=running,
            finished_ids=[k for _, k in self._finished],
            kv_url=self.sessions.kv_url,
            session_stats=self.sessions.stats(self.llm.snapshot()),
        )
        try:
            await self.kafka.send(self.topics.heartbeats.name, hb, key=self.worker_id)
        except Exception:  # noqa: BLE001 (the broker may be briefly away; the next beat retries)
            log.warning("heartbeat not sent", exc_info=True)

    async def _telemetry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.telemetry_interval_s)
            msg = self.telemetry.report(
                self.worker_id,
                self.llm.info,
                self.llm.snapshot(),
                self.settings.max_num_seqs,
                self.settings.max_num_batched_tokens,
            )
            self._update_metrics(msg)
            try:
                await self.kafka.send(self.topics.telemetry.name, msg, key=self.worker_id)
            except Exception:  # noqa: BLE001
                log.warning("telemetry not sent", exc_info=True)

    def _update_metrics(self, t) -> None:
        for cls, load in (("rt", t.rt), ("be", t.be)):
            self.m_load.labels(cls, "running").set(load.running)
            self.m_load.labels(cls, "waiting").set(load.waiting)
        self.m_kv.set(t.kv_usage)
        for r in t.finished:
            self.m_tokens.inc(r.output_tokens)
            self.m_class_tokens.labels(r.req_class).inc(r.output_tokens)
            if r.met_slo is not None:
                self.m_slo.labels(r.req_class, "true" if r.met_slo else "false").inc()
            if r.ttft_s is not None:
                self.m_ttft.labels(r.req_class).observe(r.ttft_s)
            if r.tpot_s is not None:
                self.m_tpot.labels(r.req_class).observe(r.tpot_s)
