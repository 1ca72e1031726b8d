"""What a worker tells the rest of the system about itself: heartbeats (alive, what it serves,
what it runs and finished) and telemetry (load, KV, timings), plus the Prometheus figures taken
from the same telemetry.

Both read the engine only through `AsyncLLM.info` and `AsyncLLM.snapshot()` (the immutable state
the engine publishes after every step), never its live queues.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition

from engine.async_llm import AsyncLLM
from services.worker.requests import RequestRunner
from services.worker.sessions import WorkerSessions
from services.worker.settings import WorkerSettings
from services.worker.telemetry import TelemetryWindow
from shared.hole_guard import held_position
from shared.kafka import NO_RESEND, KafkaClient
from shared.metrics import ServiceMetrics
from shared.repeat_filter import RepeatFilter
from shared.schemas.telemetry import Heartbeat, Telemetry
from shared.topics import Topics

log = logging.getLogger(__name__)

# The first pause before a failed heartbeat is sent again (doubling, within one interval): a
# refusal after a broker restart clears within tens of milliseconds (shared/produce_resend.py).
_FIRST_RETRY_S = 0.05


@dataclass
class WorkerIdentity:
    """The facts every heartbeat repeats; `epoch` and `draining` change over the worker's life."""

    worker_id: str
    model_name: str
    started_at: float
    epoch: int  # raised past each fence (re-admission)
    draining: bool = False


class WorkerReports:
    def __init__(
        self,
        settings: WorkerSettings,
        identity: WorkerIdentity,
        kafka: KafkaClient,
        topics: Topics,
        llm: AsyncLLM,
        runner: RequestRunner,
        sessions: WorkerSessions,
        telemetry: TelemetryWindow,
        metrics: ServiceMetrics,
    ) -> None:
        self.settings, self.identity = settings, identity
        self.kafka, self.topics = kafka, topics
        self.llm, self.runner, self.sessions, self.telemetry = llm, runner, sessions, telemetry
        self._init_metrics(metrics)
        self.dispatch_reader: AIOKafkaConsumer | None = None  # set once it reads (service.py)
        # An unchanged report is left out until the keepalive (shared/repeat_filter.py).
        self.telemetry_filter = RepeatFilter(settings.telemetry_keepalive_s)
        self._beats = 0  # heartbeats started: a newer one supersedes an older one's retries

    def _init_metrics(self, m: ServiceMetrics) -> None:
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

    # -- heartbeats --------------------------------------------------------------------------

    def heartbeat(self) -> Heartbeat:
        info, me = self.llm.info, self.identity
        return Heartbeat(
            worker_id=me.worker_id,
            model=me.model_name,
            max_model_len=info.max_model_len,
            dtype=info.dtype,
            device=info.device,
            dispatch_topic=self.topics.dispatch(me.worker_id).name,
            started_at=me.started_at,
            sent_at=time.time(),
            epoch=me.epoch,
            draining=me.draining,
            running_ids=self.runner.running_keys(),
            finished_ids=self.runner.finished_keys(),
            dispatch_position=self._dispatch_position(),
            kv_url=self.sessions.kv_url,
            session_stats=self.sessions.stats(self.llm.snapshot()),
        )

    def _dispatch_position(self) -> int | None:
        """The next dispatch offset the reader hands over, read in the same step as the running
        and finished ids: every dispatch below it has been through `RequestRunner.accept`, which
        the reader calls for each record before it can read on (service.py, `_dispatch_loop`)."""
        if self.dispatch_reader is None:
            return None
        topic = self.topics.dispatch(self.identity.worker_id).name
        return held_position(self.dispatch_reader, TopicPartition(topic, 0))

    async def send_heartbeat(self) -> None:
        """Send the worker's heartbeat now. A send that fails (refused right after a broker
        restart, the broker away) is tried again with a fresh heartbeat (newer state) after a
        short pause, until one is accepted, a newer beat has started, or a heartbeat interval
        has passed: never re-sent as the stale record, and never holding the caller longer than
        one interval. Why (issue 22, eleventh session): a refused heartbeat used to wait for the
        next beat, so right after every broker restart a worker went a whole timeout unheard and
        the scheduler declared it lost, re-ran its requests and fenced it."""
        self._beats += 1
        beat, began, pause = self._beats, time.monotonic(), _FIRST_RETRY_S
        while True:
            try:
                await self.kafka.send(
                    self.topics.heartbeats.name, self.heartbeat(), key=self.identity.worker_id, resend=NO_RESEND
                )
                return
            except Exception as exc:  # noqa: BLE001 (the broker may be briefly away: tried again below)
                late = time.monotonic() + pause - began > self.settings.heartbeat_interval_s
                if beat != self._beats or late:
                    log.warning("heartbeat not sent (%r); the next beat tries again", exc)
                    return
                log.info("heartbeat not sent (%r); sending a fresh one in %.2f s", exc, pause)
            await asyncio.sleep(pause)
            pause *= 2
            if beat != self._beats:
                return  # a newer beat started meanwhile: it carries the newer state

    # -- telemetry ---------------------------------------------------------------------------

    def telemetry_report(self) -> Telemetry:
        return self.telemetry.report(
            self.identity.worker_id,
            self.llm.info,
            self.llm.snapshot(),
            self.settings.max_num_seqs,
            self.settings.max_num_batched_tokens,
        )

    async def send_telemetry(self, msg: Telemetry) -> None:
        """Send `msg` unless it repeats the last report sent (and no keepalive is due)."""
        if not self.telemetry_filter.worth_sending(msg):
            return
        self.telemetry_filter.sent(msg)
        self._update_metrics(msg)
        try:
            await self.kafka.send(self.topics.telemetry.name, msg, key=self.identity.worker_id, resend=NO_RESEND)
        except Exception:  # noqa: BLE001
            log.warning("telemetry not sent", exc_info=True)

    def _update_metrics(self, t: Telemetry) -> None:
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
