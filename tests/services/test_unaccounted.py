"""When the scheduler calls a dispatched request "unaccounted for" and re-routes it
(services/scheduler/failures.py, `reroute_unaccounted`; issue 22, tenth session).

Re-routing a request that is merely late runs it twice: the gateway re-submits it from the tokens
its client has (the text stays right: the old attempt's tokens are dropped), and the old attempt
runs on. Under load a worker's dispatch reader lags its heartbeats by more than the 3 s grace,
and after a broker restart a dispatch is re-sent for seconds; both were re-routed. The rule now:
a dispatch still being sent, or one its worker's heartbeat says it has not read yet
(`dispatch_position` at or below where it landed), waits (the latter up to
`unread_dispatch_grace_s`); one the worker has read past and lists nowhere was dropped and is
re-routed at the grace, as before; a worker that does not say (older) keeps the grace alone.

Real parts: a `KafkaClient` on the session's broker carries the `Rerouted` events, read back from
the results partition they go to; the heartbeats are the worker's schema, built here."""

from __future__ import annotations

import asyncio
import time

import httpx
from aiokafka import TopicPartition

from services.scheduler.assignments import AssignmentTable
from services.scheduler.failures import FailureHandler
from services.scheduler.registry import WorkerRegistry
from services.scheduler.settings import SchedulerSettings
from shared.kafka import KafkaClient
from shared.metrics import ServiceMetrics
from shared.records import decode_record
from shared.schemas.results import Rerouted, ResultBatch
from shared.schemas.scheduler import Assignment
from shared.schemas.telemetry import Heartbeat
from shared.topics import Topics
from tests.services.conftest import chat_body, worker_heartbeat

PREFIX = "unacc"
REPLY = 3


def _assignment(rid: str, age_s: float, attempt: int = 0) -> Assignment:
    return Assignment(
        request_id=rid,
        attempt=attempt,
        worker_id="w",
        gateway_id="g",
        reply_partition=REPLY,
        req_class="rt",
        assigned_at=time.time() - age_s,
    )


def _heartbeat(position: int | None, running: list[str] = ()) -> Heartbeat:
    return Heartbeat(
        worker_id="w",
        model="m",
        max_model_len=64,
        dispatch_topic=f"{PREFIX}.dispatch.w",
        started_at=1.0,
        sent_at=time.time(),
        running_ids=list(running),
        dispatch_position=position,
    )


def test_only_a_dispatch_the_worker_read_past_or_never_reported_is_rerouted(kafka_bootstrap):
    """Six assignments, all past the 3 s grace and listed nowhere by the worker, whose
    heartbeat says it has read its dispatch topic up to offset 10 (its next is 10)."""

    async def run() -> tuple[set[str], set[str]]:
        settings = SchedulerSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix=PREFIX, unread_dispatch_grace_s=30)
        topics = Topics(PREFIX)
        kafka = KafkaClient(settings, "test-unaccounted")
        await kafka.start(topics.static())
        registry = WorkerRegistry(60.0)
        table = AssignmentTable(kafka, topics.scheduler_state.name)
        counter = ServiceMetrics("test-unaccounted").counter("rerouted_total", "x")
        handler = FailureHandler(kafka, settings, registry, table, counter, is_active=lambda: True)
        reader = await kafka.consumer(group=None)
        await kafka.assign_all(reader, topics.results.name, from_end=True, partitions=[REPLY])
        try:
            cases = {
                "read-and-dropped": (_assignment("read-and-dropped", 5), 9),  # landed at 9 < 10: read
                "not-read-yet": (_assignment("not-read-yet", 5), 10),  # landed at 10: not read yet
                "not-read-for-long": (_assignment("not-read-for-long", 40), 12),  # past the 30 s bound
                "landing-unknown": (_assignment("landing-unknown", 5), None),  # e.g. a gateway's granted copy
                "still-sending": (_assignment("still-sending", 5), None),
                # attempt 1's dispatch failed; what landed (unread) was attempt 0's: no sign for attempt 1
                "old-attempt-landed": (_assignment("old-attempt-landed", 5, attempt=1), 11),
            }
            for rid, (a, offset) in cases.items():
                table.by_request[rid] = a
                if offset is not None:
                    # "old-attempt-landed": what landed is attempt 0's dispatch, not this attempt's
                    table.landed[rid] = (0 if rid == "old-attempt-landed" else a.attempt, offset)
            table.sending.add("still-sending")
            registry.on_heartbeat(_heartbeat(10))
            await handler.reroute_unaccounted(active_since=time.monotonic() - 60)
            rerouted = await _rerouted(reader, TopicPartition(topics.results.name, REPLY), expected=4)
            return rerouted, set(table.by_request)
        finally:
            await kafka.stop()

    rerouted, kept = asyncio.run(run())
    assert rerouted == {"read-and-dropped", "not-read-for-long", "landing-unknown", "old-attempt-landed"}
    assert kept == {"not-read-yet", "still-sending"}


def test_a_worker_that_does_not_say_how_far_it_read_keeps_the_grace_alone(kafka_bootstrap):
    async def run() -> set[str]:
        settings = SchedulerSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix=PREFIX)
        topics = Topics(PREFIX)
        kafka = KafkaClient(settings, "test-unaccounted-old")
        await kafka.start(topics.static())
        registry = WorkerRegistry(60.0)
        table = AssignmentTable(kafka, topics.scheduler_state.name)
        counter = ServiceMetrics("test-unaccounted-old").counter("rerouted_total", "x")
        handler = FailureHandler(kafka, settings, registry, table, counter, is_active=lambda: True)
        reader = await kafka.consumer(group=None)
        await kafka.assign_all(reader, topics.results.name, from_end=True, partitions=[REPLY])
        try:
            for rid, age in (("old-worker-late", 5.0), ("old-worker-young", 0.5), ("old-worker-running", 5.0)):
                table.by_request[rid] = _assignment(rid, age)
                table.landed[rid] = (0, 50)
            registry.on_heartbeat(_heartbeat(None, running=["old-worker-running:0"]))
            await handler.reroute_unaccounted(active_since=time.monotonic() - 60)
            return await _rerouted(reader, TopicPartition(topics.results.name, REPLY), expected=1)
        finally:
            await kafka.stop()

    assert asyncio.run(run()) == {"old-worker-late"}


async def _rerouted(reader, tp: TopicPartition, expected: int) -> set[str]:
    """The request ids of the `Rerouted` events on the reply partition: `expected` of them, and
    then nothing more for a while (one fetch round after the last)."""
    got: set[str] = set()
    async with asyncio.timeout(120):  # a safety net: the sends were acknowledged before this reads
        while len(got) < expected:
            for msgs in (await reader.getmany(tp, timeout_ms=500)).values():
                got |= _ids(msgs)
    for msgs in (await reader.getmany(tp, timeout_ms=1000)).values():  # none beyond them
        got |= _ids(msgs)
    return got


def _ids(msgs) -> set[str]:
    out = set()
    for m in msgs:
        batch = decode_record(ResultBatch, m)
        out |= {e.request_id for e in batch.events if isinstance(e, Rerouted)} if batch else set()
    return out


def test_a_reroute_the_broker_refuses_is_kept_for_the_next_pass():
    """A re-route whose `Rerouted` the broker refuses past every re-send (a restarted tansu with
    more stale slots on the reply partition than a record may try, made here as a restart makes
    them) neither raises (it used to end the scheduler's housekeeping loop for good) nor forgets
    the assignment: the next pass sends it, past the remaining stale slots."""
    import subprocess

    from aiokafka import AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from services.broker import start_broker
    from shared.produce_resend import RESEND

    topics = Topics("unacc-refused")
    proc, bootstrap = start_broker(tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stale_slots = RESEND.attempts + 1 + 5  # one more than a send tries, and 5 for the next pass

    async def results_topic(*, delete: bool) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            if delete:
                await admin.delete_topics([topics.results.name])
            else:
                await admin.create_topics([NewTopic(topics.results.name, topics.results.partitions, 1)])
        finally:
            await admin.close()

    async def run() -> tuple[bool, int, bool, int, set[str]]:
        # tansu's state after a restart, made without one: a producer with cached metadata
        # writes to a topic the broker does not have (deleted here), one batch per record, each
        # stored at the next slot; the topic is then created again, its watermark back to 0
        await results_topic(delete=False)
        stale = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
        await stale.start()
        await stale.partitions_for(topics.results.name)  # metadata cached, nothing written
        await results_topic(delete=True)
        for i in range(stale_slots):
            await stale.send_and_wait(topics.results.name, f"stale-{i}".encode(), partition=REPLY)
        await stale.stop()
        await results_topic(delete=False)
        settings = SchedulerSettings(kafka_bootstrap=bootstrap, topic_prefix=topics.prefix)
        kafka = KafkaClient(settings, "test-unaccounted-refused")
        await kafka.start(topics.static())
        try:
            table = AssignmentTable(kafka, topics.scheduler_state.name)
            counter = ServiceMetrics("test-unaccounted-refused").counter("rerouted_total", "x")
            handler = FailureHandler(kafka, settings, WorkerRegistry(60.0), table, counter, is_active=lambda: True)
            a = table.by_request["r"] = _assignment("r", 5)
            await handler.reroute(a, "request unaccounted for")  # every try refused: kept, no raise
            kept_after_first = "r" in table.by_request
            first_count = counter._value.get()  # noqa: SLF001 (prometheus_client has no public read)
            await handler.reroute_unaccounted(active_since=time.monotonic() - 60)  # the next pass
            reader = await kafka.consumer(group=None)
            await kafka.assign_all(reader, topics.results.name, from_end=False, partitions=[REPLY])
            rerouted = await _rerouted(reader, TopicPartition(topics.results.name, REPLY), expected=1)
            return kept_after_first, first_count, "r" in table.by_request, counter._value.get(), rerouted  # noqa: SLF001
        finally:
            await kafka.stop()

    try:
        kept_after_first, first_count, kept_after_second, count, rerouted = asyncio.run(run())
    finally:
        proc.kill()
        proc.wait()
    assert kept_after_first and first_count == 0
    assert not kept_after_second and count == 1 and rerouted == {"r"}


def test_a_worker_heartbeat_says_how_far_it_has_read_its_dispatch_topic(make_stack):
    """The real worker fills `dispatch_position`: each request it serves moves it on by one
    dispatch (its own topic, partition 0), so the scheduler's rule above has its input."""
    stack = make_stack().start(("w0",))
    before = asyncio.run(asyncio.wait_for(worker_heartbeat(stack, "w0"), 120)).dispatch_position
    assert before is not None
    for i in range(2):
        r = httpx.post(f"{stack.url}/v1/chat/completions", json=chat_body(f"position {i}", 4), timeout=300)
        assert r.status_code == 200, r.text
    moved = lambda hb: hb.dispatch_position is not None and hb.dispatch_position >= before + 2  # noqa: E731
    after = asyncio.run(asyncio.wait_for(worker_heartbeat(stack, "w0", moved), 120))  # a safety net: beats ~1/s
    assert after.dispatch_position == before + 2 and not after.running_ids
