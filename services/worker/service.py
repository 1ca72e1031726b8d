"""The worker service: one engine per process, fed by its dispatch topic.

Tasks: read dispatch (one stream task per request), read control (cancel, drain), publish
heartbeats and telemetry. Token deltas leave through `ResultOutbox`, one message per gateway
partition per engine step. A request is keyed "request_id:attempt" so a re-delivered dispatch
(consumer restart) is applied once and a resumed attempt never collides with a stale one.
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

from aiokafka import AIOKafkaConsumer

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from services.worker.adapter import EngineRequest, to_engine_request
from services.worker.outbox import ResultOutbox
from services.worker.sessions import WorkerSessions
from services.worker.settings import WorkerSettings
from services.worker.telemetry import TelemetryWindow, request_timing
from shared.kafka import KafkaClient
from shared.metrics import ServiceMetrics
from shared.schemas.control import Cancel, ControlEnvelope, Drain, Prefetch
from shared.schemas.requests import GenerateRequest
from shared.schemas.results import Accepted, Delta, Failed
from shared.schemas.telemetry import Heartbeat
from shared.topics import Topics

log = logging.getLogger(__name__)
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
        self.llm = AsyncLLM(self._engine_config(settings, self.session_dir))
        self.outbox = ResultOutbox(self.kafka, self.topics.results.name, self.worker_id)
        self.sessions = WorkerSessions(
            self.llm, self.kafka, self.topics.sessions_directory.name, self.worker_id, settings, self.session_dir
        )
        self.telemetry = TelemetryWindow()
        self.draining = False
        self.started_at = time.time()
        self._tasks: dict[str, asyncio.Task] = {}  # request_id -> its stream task
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._finished: deque[tuple[float, str]] = deque()
        self._background: list[asyncio.Task] = []
        self._init_metrics()

    def _init_metrics(self) -> None:
        m = self.metrics = ServiceMetrics("worker")
        self.m_load = m.gauge("worker_requests", "requests in the engine", ("req_class", "state"))
        self.m_kv = m.gauge("worker_kv_usage", "fraction of KV blocks in use")
        self.m_tokens = m.counter("worker_output_tokens_total", "tokens generated")
        self.m_ttft = m.histogram("worker_ttft_seconds", "engine time to first token", ("req_class",))
        self.m_tpot = m.histogram("worker_tpot_seconds", "engine time per output token", ("req_class",))

    @staticmethod
    def _engine_config(s: WorkerSettings, session_dir) -> EngineConfig:
        return EngineConfig(
            model=s.model,
            load_format=s.load_format,
            device=s.device,
            dtype=s.dtype,
            kv_cache_gib=s.kv_cache_gib,
            policy=s.policy,
            uncached_ratio=s.uncached_ratio,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_model_len=s.max_model_len,
            num_threads=s.num_threads,
            attention=s.attention,
            compile_layers=s.compile_layers,
            enable_prefix_caching=s.enable_prefix_caching,
            session_dir=str(session_dir),
            session_host_gib=s.session_host_gib,
            session_disk_gib=s.session_disk_gib,
            session_eviction=s.session_eviction,
            session_prefetch_ttl_s=s.session_prefetch_ttl_s,
        )

    # -- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        # The engine thread holds the GIL through long stretches of Python between tensor ops; a
        # short switch interval lets the event-loop thread forward tokens without waiting the
        # default 5 ms for its turn (that wait showed up as +10 ms per token on the Kafka path).
        sys.setswitchinterval(self.settings.gil_switch_interval_s)
        await self.llm.start()
        dispatch = self.topics.dispatch(self.worker_id)
        await self.kafka.start([*self.topics.static(), dispatch])
        await self.sessions.start()
        self._dispatch = await self.kafka.consumer(dispatch.name, group=f"tandem-worker-{self.worker_id}", hot=True)
        self._control = await self.kafka.consumer(group=None)
        await self.kafka.assign_all(self._control, self.topics.control.name, from_end=True)
        loops = (self._dispatch_loop(), self._control_loop(), self._heartbeat_loop(), self._telemetry_loop())
        self._background = [asyncio.create_task(c) for c in loops]
        await self._send_heartbeat()
        self.metrics.serve(self.settings.metrics_port)
        log.info("worker %s serving %r (dispatch topic %s)", self.worker_id, self.model_name, dispatch.name)

    async def stop(self) -> None:
        """Drain: stop taking work, let running requests finish (bounded), flush, close."""
        self.draining = True
        await self._send_heartbeat()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=self.settings.drain_timeout_s)
        for t in [*self._tasks.values(), *self._background]:
            t.cancel()
        await asyncio.gather(*self._tasks.values(), *self._background, return_exceptions=True)
        await self.outbox.drain()
        await self.sessions.stop()
        await self.kafka.stop()
        await self.llm.shutdown()

    # -- dispatch ------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        consumer: AIOKafkaConsumer = self._dispatch
        while True:
            batches = await consumer.getmany(timeout_ms=100)
            for messages in batches.values():
                for msg in messages:
                    self._accept(msg.value)
            if batches:
                await consumer.commit()  # accepted into the engine: a redelivery would be a duplicate

    def _accept(self, raw: bytes) -> None:
        try:
            req = GenerateRequest.decode(raw)
        except ValueError:
            log.exception("undecodable dispatch message dropped")
            return
        key = f"{req.request_id}:{req.attempt}"
        log.debug("dispatch received", extra={"request_id": req.request_id})
        if key in self._seen:
            return
        self._remember(key)
        old = self._tasks.get(req.request_id)
        if old is not None:
            old.cancel()  # an older attempt of the same request still here: the new one wins
        self._tasks[req.request_id] = asyncio.create_task(self._serve(req), name=key)

    def _remember(self, key: str) -> None:
        self._seen[key] = None
        while len(self._seen) > _SEEN_LIMIT:
            self._seen.popitem(last=False)

    async def _serve(self, req: GenerateRequest) -> None:
        part = req.reply_partition
        try:
            er = to_engine_request(req, self.llm.tokenizer, self.llm.engine.max_model_len)
            self.llm.engine.validate(er.prompt_token_ids + er.resumed_output_ids, er.params)
        except ValueError as exc:
            self.outbox.put(part, Failed(request_id=req.request_id, attempt=req.attempt, message=str(exc)))
            self._forget(req)
            return
        self.outbox.put(
            part,
            Accepted(
                request_id=req.request_id,
                attempt=req.attempt,
                worker_id=self.worker_id,
                prompt_tokens=len(er.prompt_token_ids),
            ),
        )
        try:
            if req.session_id is not None:
                await self.sessions.prepare(req, len(er.prompt_token_ids))
            await self._stream(req, er)
        finally:
            self._forget(req)

    async def _stream(self, req: GenerateRequest, er: EngineRequest) -> None:
        index = len(er.resumed_output_ids)
        async for d in self.llm.generate(
            er.key,
            er.prompt_token_ids,
            er.params,
            req_class=er.req_class,
            slo=er.slo,
            resumed_output_ids=er.resumed_output_ids,
            session_id=req.session_id,
        ):
            if index == len(er.resumed_output_ids):
                log.debug("first delta", extra={"request_id": req.request_id})
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
                    token_texts=self._token_texts(d.token_ids) if d.logprobs is not None else None,
                    prompt_tokens=len(er.prompt_token_ids) if d.finished else None,
                    cached_tokens=final.num_cached_tokens if final else None,
                ),
            )
            index += len(d.token_ids)
            if final is not None:
                self.telemetry.finished(request_timing(req.request_id, er.req_class, er.slo, final))

    def _token_texts(self, token_ids: list[int]) -> list[str]:
        if self.llm.tokenizer is None:  # a tokenizer-free (dummy) model: ids only
            return [""] * len(token_ids)
        return [self.llm.tokenizer.decode([t]) for t in token_ids]

    def _forget(self, req: GenerateRequest) -> None:
        if self._tasks.get(req.request_id) is asyncio.current_task():
            del self._tasks[req.request_id]
        self._finished.append((time.monotonic(), f"{req.request_id}:{req.attempt}"))

    # -- control -------------------------------------------------------------------------

    async def _control_loop(self) -> None:
        while True:
            msg = await self._control.getone()
            try:
                cmd = ControlEnvelope.decode(msg.value).message
            except ValueError:
                log.exception("undecodable control message dropped")
                continue
            if isinstance(cmd, Cancel):
                task = self._tasks.get(cmd.request_id)
                if task is not None:
                    task.cancel()  # leaving the engine stream aborts the request and frees its KV
                    log.info("cancelled", extra={"request_id": cmd.request_id})
            elif isinstance(cmd, Prefetch) and cmd.worker_id == self.worker_id:
                self.sessions.on_prefetch(cmd)
            elif isinstance(cmd, Drain) and cmd.worker_id == self.worker_id:
                self.draining = True
                await self._send_heartbeat()

    # -- heartbeats and telemetry ----------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            await self._send_heartbeat()

    async def _send_heartbeat(self) -> None:
        now = time.monotonic()
        while self._finished and self._finished[0][0] < now - _FINISHED_WINDOW_S:
            self._finished.popleft()
        running = [t.get_name() for t in self._tasks.values()]
        engine_config = self.llm.engine.config
        hb = Heartbeat(
            worker_id=self.worker_id,
            model=self.model_name,
            max_model_len=self.llm.engine.max_model_len,
            dtype=engine_config.dtype,
            device=engine_config.device,
            dispatch_topic=self.topics.dispatch(self.worker_id).name,
            started_at=self.started_at,
            sent_at=time.time(),
            draining=self.draining,
            running_ids=running,
            finished_ids=[k for _, k in self._finished],
            kv_url=self.sessions.kv_url,
            session_stats=self._session_stats(),
        )
        try:
            await self.kafka.send(self.topics.heartbeats.name, hb, key=self.worker_id)
        except Exception:  # noqa: BLE001 (the broker may be briefly away; the next beat retries)
            log.warning("heartbeat not sent", exc_info=True)

    def _session_stats(self) -> dict[str, float]:
        try:
            return self.sessions.stats()
        except RuntimeError:  # a counter dict resized by the engine thread mid-read: next beat
            return {}

    async def _telemetry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.telemetry_interval_s)
            msg = self.telemetry.report(self.worker_id, self.llm.engine, self.settings.max_num_seqs)
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
            if r.ttft_s is not None:
                self.m_ttft.labels(r.req_class).observe(r.ttft_s)
            if r.tpot_s is not None:
                self.m_tpot.labels(r.req_class).observe(r.tpot_s)
