"""The Kafka layer and wire schemas against the real broker."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition

from shared.kafka import KafkaClient, OffsetTracker
from shared.schemas.control import Cancel, ControlEnvelope, Drain
from shared.schemas.requests import GenerateRequest
from shared.schemas.results import Accepted, Delta, Rerouted, ResultBatch
from shared.settings import ServiceSettings
from shared.topics import Topics, TopicSpec
from tests.shared.waiting import read_ids

pytestmark = pytest.mark.timeout(300)


def _request(**kw) -> GenerateRequest:
    return GenerateRequest(
        request_id="r1",
        gateway_id="g",
        reply_partition=3,
        model="m",
        kind="chat",
        messages=[{"role": "user", "content": "hi"}],
        created_at=1.0,
        **kw,
    )


def test_schemas_round_trip_and_discriminate():
    req = _request()
    assert GenerateRequest.decode(req.encode()) == req
    resumed = req.resumed([5, 6])
    assert resumed.attempt == 1 and resumed.resume_token_ids == [5, 6] and req.attempt == 0
    batch = ResultBatch(
        source="w",
        events=[
            Accepted(request_id="a", worker_id="w", prompt_tokens=3),
            Delta(request_id="a", index=0, token_ids=[1], text="x"),
            Rerouted(request_id="b", reason="lost"),
        ],
    )
    assert [type(e) for e in ResultBatch.decode(batch.encode()).events] == [Accepted, Delta, Rerouted]
    env = ControlEnvelope.decode(ControlEnvelope(message=Drain(worker_id="w")).encode())
    assert isinstance(env.message, Drain)
    with pytest.raises(ValueError):  # a newer major version is refused, not misread
        GenerateRequest.decode(req.model_copy(update={"schema_version": 99}).encode())


def test_offset_tracker_commits_only_below_unfinished_work():
    tp = TopicPartition("t", 0)
    t = OffsetTracker()
    for off in (10, 11, 12):
        t.started(tp, off)
    t.done(tp, 11)
    assert t.committable() == {tp: 10}  # 10 unfinished: a restart redelivers 10, 11, 12
    t.done(tp, 10)
    assert t.committable() == {tp: 12}
    t.done(tp, 12)
    assert t.committable() == {tp: 13}


def test_topic_catalogue_is_complete():
    names = {t.name for t in Topics("p").static()}
    assert {
        "p.requests.rt",
        "p.requests.be",
        "p.results",
        "p.control",
        "p.telemetry",
        "p.heartbeats",
        "p.owners",
        "p.scheduler.state",
        "p.scheduler.fences",
        "p.be.capacity",
        "p.placement.grants",
        "p.batches",
        "p.advisory",
        "p.sessions.directory",
        "p.sessions.placement",
        "p.leases",
    } == names
    assert Topics("p").sessions_directory.compacted and Topics("p").sessions_placement.compacted
    assert Topics("p").scheduler_state.compacted and Topics("p").dispatch("w1").name == "p.dispatch.w1"


def test_send_consume_commit_and_redelivery(kafka_bootstrap):
    settings = ServiceSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix="kl")
    topics = Topics("kl")

    async def run():
        kafka = KafkaClient(settings, "test")
        await kafka.start(topics.static())
        await kafka.ensure_topics(topics.static())  # idempotent
        for i in range(3):
            await kafka.send(topics.control.name, ControlEnvelope(message=Cancel(request_id=f"r{i}")), key=f"r{i}")
        c = await kafka.consumer(topics.control.name, group="kl-g")
        got = []
        while len(got) < 3:
            for msgs in (await c.getmany(timeout_ms=500)).values():
                got += [ControlEnvelope.decode(m.value).message.request_id for m in msgs]
        # commit only the first message, then a new member of the group sees the other two again
        await c.commit({TopicPartition(topics.control.name, 0): 1})
        await c.stop()
        c2 = await kafka.consumer(topics.control.name, group="kl-g")
        again = []
        while len(again) < 2:
            for msgs in (await c2.getmany(timeout_ms=500)).values():
                again += [ControlEnvelope.decode(m.value).message.request_id for m in msgs]
        await kafka.stop()
        return got, again

    got, again = asyncio.run(run())
    assert got == ["r0", "r1", "r2"] and again == ["r1", "r2"]


def test_owned_consumer_resumes_from_its_groups_commits_without_joining(kafka_bootstrap):
    """A worker's dispatch consumer: assigned, not subscribed (no rebalance round), yet a restart
    reads on from the offsets it committed."""
    settings = ServiceSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix="ko")
    topic = "ko.dispatch.w"

    async def run():
        kafka = KafkaClient(settings, "test")
        await kafka.start([TopicSpec(topic, 1, "request id")])
        for i in range(3):
            await kafka.send(topic, ControlEnvelope(message=Cancel(request_id=f"r{i}")))
        c = await kafka.owned_consumer(topic, group="ko-w", hot=True)
        first = await read_ids(c, 3)
        await c.commit({TopicPartition(topic, 0): 2})
        await kafka.stop()
        again = KafkaClient(settings, "test")
        await again.start()
        c2 = await again.owned_consumer(topic, group="ko-w", hot=True)
        rest = await read_ids(c2, 1)
        await again.stop()
        return first, rest

    first, rest = asyncio.run(run())
    assert first == ["r0", "r1", "r2"] and rest == ["r2"]


def test_owned_consumer_reads_from_the_start_past_a_commit_beyond_the_end(kafka_bootstrap):
    """A commit from a broker that lost its data (aiokafka retries a commit in flight until the
    restarted broker has the topic again; `tandem chaos --ha --faults broker`): the group's offset
    9 on a topic of 2 records. tansu answers a fetch at 9 with nothing, so a consumer started there
    never read the records below it (a standby scheduler taking over placed nothing). It now reads
    them from the start; a partition whose commit is within its end still resumes there."""
    settings = ServiceSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix="kp")
    topic = "kp.requests"
    stale, kept = TopicPartition(topic, 0), TopicPartition(topic, 1)

    async def run():
        kafka = KafkaClient(settings, "test")
        await kafka.start([TopicSpec(topic, 2, "request id")])
        for i in range(2):
            await kafka.send(topic, ControlEnvelope(message=Cancel(request_id=f"p0-{i}")), partition=0)
            await kafka.send(topic, ControlEnvelope(message=Cancel(request_id=f"p1-{i}")), partition=1)
        committer = await kafka.consumer(group="kp-s", subscribe=False)
        committer.assign([stale, kept])
        await committer.commit({stale: 9, kept: 1})  # 9: past partition 0's end (2)
        await committer.stop()
        c = await kafka.owned_consumer(topic, group="kp-s", hot=True)
        got = await asyncio.wait_for(read_ids(c, 3), 60)
        await kafka.stop()
        return got

    got = asyncio.run(run())
    assert sorted(got) == ["p0-0", "p0-1", "p1-1"], got


def test_a_consumer_whose_start_is_cancelled_is_closed(monkeypatch):
    """A service stopped while its broker is down cancels a consumer's start mid-retry: that
    consumer is closed, not left for the garbage collector to report as an "Unclosed
    AIOKafkaConsumer" at exit (what the advisory logged when stopped after its broker died)."""
    from services.broker import free_port
    from shared.quiet_consumer import QuietConsumer

    attempts: list[QuietConsumer] = []
    original = QuietConsumer.start

    async def counted_start(self) -> None:
        attempts.append(self)
        await original(self)

    monkeypatch.setattr(QuietConsumer, "start", counted_start)

    async def main() -> None:
        kafka = KafkaClient(ServiceSettings(kafka_bootstrap=f"127.0.0.1:{free_port()}"), "test-cancelled-start")
        starting = asyncio.create_task(kafka.consumer(group=None))
        while len(attempts) < 2:  # nothing listens there: the first start failed, a retry is under way
            await asyncio.sleep(0.05)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        await kafka.stop()

    asyncio.run(main())
    assert attempts[0] is attempts[-1] and attempts[0]._closed is True
