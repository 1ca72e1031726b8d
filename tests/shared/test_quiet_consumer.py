"""How the embedded broker answers fetches, and the consumer that sleeps when idle (real tansu)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from shared.kafka import KafkaClient
from shared.quiet_consumer import QuietConsumer
from shared.schemas.control import Cancel, ControlEnvelope
from shared.settings import ServiceSettings
from shared.topics import TopicSpec
from tests.shared.waiting import read_ids, until

pytestmark = pytest.mark.timeout(300)


def _envelope(i: int) -> ControlEnvelope:
    return ControlEnvelope(message=Cancel(request_id=f"r{i}"))


def test_tansu_answers_a_fetch_at_its_deadline_not_when_data_arrives(kafka_bootstrap):
    """The reason for `QuietConsumer`: with a 2 s fetch wait, a record sent while the fetch waits
    is delivered only when a fetch ends (tansu sleeps half the wait, then answers with what it
    read at the start), not at once as Apache Kafka would.

    The phase decides what one try sees: a record that reaches the broker before the consumer's
    next fetch is read at once (a race: aiokafka sends that fetch only once the previous records
    were handed out). Sending at an arbitrary moment measured anything from 1 ms to the wait, and
    this test failed at 0.27 s that way. So each try reads a first record, gives the next fetch
    0.2 s to reach the broker, then sends the measured one; a broker that answers on arrival
    (Apache Kafka) is fast in every try, tansu is slow in almost every one: one slow try of five
    is what the property needs."""

    async def run() -> list[float]:
        topic = "qc-deadline"
        kafka = KafkaClient(ServiceSettings(kafka_bootstrap=kafka_bootstrap), "qc")
        await kafka.ensure_topics([TopicSpec(topic, 1, "none")])
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, fetch_max_wait_ms=2000, fetch_min_bytes=1)
        await producer.start()
        await consumer.start()
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        delays: list[float] = []
        while len(delays) < 5 and not any(d > 0.3 for d in delays):
            await producer.send_and_wait(topic, b"first")
            while not await consumer.getmany(timeout_ms=5000):
                pass
            await asyncio.sleep(0.2)  # the phase, not an event wait: see the docstring
            t0 = time.perf_counter()
            await producer.send_and_wait(topic, b"x")
            while not await consumer.getmany(timeout_ms=5000):
                pass
            delays.append(time.perf_counter() - t0)
        await consumer.stop()
        await producer.stop()
        return delays

    delays = asyncio.run(run())
    assert any(d > 0.3 for d in delays), delays


def test_quiet_consumer_sleeps_wakes_on_a_ring_and_keeps_the_services_pause(kafka_bootstrap):
    settings = ServiceSettings(kafka_bootstrap=kafka_bootstrap, kafka_idle_poll_ms=60_000)

    async def run() -> None:
        topic = "qc-ring"
        kafka = KafkaClient(settings, "qc")
        await kafka.start([TopicSpec(topic, 1, "none")])
        raw = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")  # rings no bell
        await raw.start()
        consumer = await kafka.consumer(group=None, hot=True)
        assert isinstance(consumer, QuietConsumer)
        (tp,) = await kafka.assign_all(consumer, topic, from_end=True)
        await until(lambda: consumer.sleeping, "the idle consumer to sleep")

        # Asleep it sends no fetch: a record produced without a ring stays unread (an awake
        # consumer would return it within one 2 ms fetch) ...
        await raw.send_and_wait(topic, _envelope(0).encode())
        consumer.resume(tp)  # the service lifting a pause it never made (the scheduler does) ...
        assert await consumer.getmany(timeout_ms=300) == {}
        # ... wakes nothing; a producer of this package ringing: both records come at once.
        await kafka.send(topic, _envelope(1))
        assert await read_ids(consumer, 2, timeout_ms=1000) == ["r0", "r1"]
        await until(lambda: consumer.sleeping, "the consumer to sleep again", timeout_s=30.0)

        # A partition the service paused (flow control) stays paused through a ring.
        consumer.pause(tp)
        await kafka.send(topic, _envelope(2))
        assert consumer.paused() == {tp}
        assert await consumer.getmany(timeout_ms=100) == {}
        consumer.resume(tp)
        assert await read_ids(consumer, 1, timeout_ms=1000) == ["r2"]
        await raw.stop()
        await kafka.stop()

    asyncio.run(run())


def test_quiet_consumer_reads_unrung_records_at_its_idle_poll(kafka_bootstrap):
    """A lost ring (or a producer outside this package) delays a record, never loses it."""
    settings = ServiceSettings(kafka_bootstrap=kafka_bootstrap, kafka_idle_poll_ms=200)

    async def run() -> None:
        topic = "qc-poll"
        kafka = KafkaClient(settings, "qc")
        await kafka.start([TopicSpec(topic, 1, "none")])
        raw = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        await raw.start()
        consumer = await kafka.consumer(group=None, hot=True)
        await kafka.assign_all(consumer, topic, from_end=True)
        await until(lambda: consumer.sleeping, "the idle consumer to sleep")
        await raw.send_and_wait(topic, _envelope(7).encode())
        assert await read_ids(consumer, 1, timeout_ms=1000) == ["r7"]
        await raw.stop()
        await kafka.stop()

    asyncio.run(run())


def test_long_poll_brokers_get_plain_consumers_and_no_doorbell(kafka_bootstrap):
    settings = ServiceSettings(kafka_bootstrap=kafka_bootstrap, kafka_long_poll=True)

    async def run() -> None:
        kafka = KafkaClient(settings, "qc")
        await kafka.start([TopicSpec("qc-long", 1, "none")])
        consumer = await kafka.consumer(group=None, hot=True)
        assert not isinstance(consumer, QuietConsumer) and kafka.doorbell is None
        await kafka.assign_all(consumer, "qc-long", from_end=True)
        await kafka.send("qc-long", _envelope(3))
        assert await read_ids(consumer, 1, timeout_ms=1000) == ["r3"]
        await kafka.stop()

    asyncio.run(run())


def test_quiet_consumer_never_rearms_a_sub_millisecond_timer(kafka_bootstrap, monkeypatch):
    """uvloop may fire a timer up to 1 ms early; the awake window must then count as over rather
    than re-arm a near-zero timer in a loop (it did: ~40 wake-ups a second per idle consumer)."""
    import sys

    import uvloop

    real_sleep = asyncio.sleep
    short: list[float] = []

    async def counting_sleep(delay, *args):
        if sys._getframe(1).f_code.co_name == "_watch" and delay < 0.001:
            short.append(delay)
        return await real_sleep(delay, *args)

    monkeypatch.setattr(asyncio, "sleep", counting_sleep)
    settings = ServiceSettings(kafka_bootstrap=kafka_bootstrap, kafka_idle_poll_ms=60_000)

    async def run() -> None:
        topic = "qc-timer"
        kafka = KafkaClient(settings, "qc")
        await kafka.start([TopicSpec(topic, 1, "none")])
        hot = await kafka.consumer(group=None, hot=True)
        cold = await kafka.consumer(group=None)
        for c in (hot, cold):
            await kafka.assign_all(c, topic, from_end=True)
        for i in range(10):  # each record wakes both, and both fall asleep again
            await until(lambda: hot.sleeping and cold.sleeping, "both consumers to sleep", timeout_s=30.0)
            await kafka.send(topic, _envelope(i))
            assert await read_ids(hot, 1, timeout_ms=1000) == [f"r{i}"]
            assert await read_ids(cold, 1, timeout_ms=1000) == [f"r{i}"]
        await kafka.stop()

    uvloop.run(run())
    assert short == []


def test_a_reader_off_the_token_path_sleeps_once_it_has_read_what_it_was_rung_for(kafka_bootstrap):
    """A ring says where its record landed, so a reader off the token path sleeps as soon as its
    position is past it, not after the awake window (an hour here: only the early sleep can put
    it to sleep within the test). Records rung back to back, faster than one fetch wait, are all
    read: a fetch that answered before one of them existed leaves the position short of its
    offset, so the reader fetches again rather than sleeping (its own looks are an hour apart:
    an unread record would hang the test)."""
    # kafka_hot_settle off: the hot reader keeps its awake window, the mode the setting still offers
    # (on by default since the ninth session, the token path sleeps early too:
    # tests/shared/test_quiet_consumer_early_sleep.py)
    settings = ServiceSettings(
        kafka_bootstrap=kafka_bootstrap, kafka_awake_ms=3_600_000, kafka_idle_poll_ms=3_600_000, kafka_hot_settle=False
    )

    async def run() -> None:
        topic = "qc-settle"
        kafka = KafkaClient(settings, "qc")
        await kafka.start([TopicSpec(topic, 1, "none")])
        cold = await kafka.consumer(group=None)
        hot = await kafka.consumer(group=None, hot=True)
        for c in (cold, hot):
            await kafka.assign_all(c, topic, from_end=True)
        # Right after start nothing was rung: the awake window (an hour) would keep it up; one
        # record rung and read puts it to sleep.
        await kafka.send(topic, _envelope(0))
        assert await read_ids(cold, 1, timeout_ms=1000) == ["r0"]
        await until(lambda: cold.sleeping, "the reader to sleep on the rung record's answer", timeout_s=30.0)
        for i in range(1, 6):
            acks = [await kafka.send_nowait(topic, _envelope(10 * i + k)) for k in range(3)]
            await asyncio.gather(*acks)
            assert await read_ids(cold, 3, timeout_ms=1000) == [f"r{10 * i + k}" for k in range(3)]
            await until(lambda: cold.sleeping, "the reader to sleep again", timeout_s=30.0)
        # The token path with kafka_hot_settle off keeps its awake window: it reads everything too,
        # and is not asleep
        # (its window is an hour; asserted on a reader whose window cannot have run out).
        assert len(await read_ids(hot, 16, timeout_ms=1000)) == 16 and not hot.sleeping
        await kafka.stop()

    asyncio.run(run())


def test_a_sleeping_consumer_rung_as_it_stops_still_stops(kafka_bootstrap):
    """A ring that wakes a sleeping consumer in the same moment as its stop cancels its watch:
    the stop ends. With `asyncio.wait_for` as the idle wait, Python 3.11 swallowed that
    cancellation (shared/aio.py) and the stop waited forever: a scheduler hung at stop that way
    when the other services' lease releases rang its lease consumer. Tried at each of the first
    few loop turns after the ring, since which turn meets the cancellation decides it."""
    settings = ServiceSettings(kafka_bootstrap=kafka_bootstrap, kafka_idle_poll_ms=60_000)

    async def run() -> None:
        topic = "qc-stop-rung"
        kafka = KafkaClient(settings, "qc")
        await kafka.start([TopicSpec(topic, 1, "none")])
        try:
            for turns in range(4):
                consumer = await kafka.consumer(group=None, hot=True)
                await kafka.assign_all(consumer, topic, from_end=True)
                await until(lambda c=consumer: c.sleeping, "the idle consumer to sleep")
                consumer.wake()  # what the doorbell calls on a ring
                for _ in range(turns):
                    await asyncio.sleep(0)
                stop = asyncio.create_task(consumer.stop())
                await asyncio.wait({stop}, timeout=60)  # a safety net: a clean stop takes milliseconds
                assert stop.done(), f"the stop hung when the ring met it {turns} loop turns later"
                stop.result()
        finally:
            await kafka.stop()

    asyncio.run(run())


def test_a_ring_for_a_partition_the_reader_does_not_hold_leaves_it_asleep(kafka_bootstrap):
    """Each gateway and the queue read their own partition of the results topic, whose bell rings
    for every partition. A sleeping reader of partition 0 rung for a record on partition 1 stays
    asleep (it used to wake for its awake window and fetch every 2 ms); the state is read in the
    wake-up call itself, so no race with its fetches. Rung for its own partition, it wakes and
    reads the record."""
    settings = ServiceSettings(kafka_bootstrap=kafka_bootstrap, kafka_idle_poll_ms=3_600_000)

    async def run() -> None:
        topic = "qc-foreign"
        kafka = KafkaClient(settings, "qc")
        await kafka.start([TopicSpec(topic, 2, "none")])
        reader = await kafka.consumer(group=None, hot=True)
        await kafka.assign_all(reader, topic, from_end=True, partitions=[0])
        assert isinstance(reader, QuietConsumer)
        await until(lambda: reader.sleeping, "the idle reader to sleep")
        woken: list[tuple[list[bytes] | None, bool]] = []
        wake = reader.wake

        def recorded(topic: str | None = None, payloads: list[bytes] | None = None) -> None:
            wake(topic, payloads)
            woken.append((payloads, reader.sleeping))

        reader.wake = recorded
        await kafka.send(topic, _envelope(1), partition=1)
        await until(lambda: woken, "the ring for partition 1")
        assert woken[0] == ([b"1:0"], True)
        await kafka.send(topic, _envelope(0), partition=0)
        assert await read_ids(reader, 1, timeout_ms=1000) == ["r0"]
        assert woken[-1] == ([b"0:0"], False)  # its own partition's ring woke it
        await kafka.stop()

    asyncio.run(run())
