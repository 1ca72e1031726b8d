"""The hole guard on a real tansu (shared/hole_guard.py): a restarted broker's hole is made the way
it happens under a live stack, and a consumer stuck at it reads on; a consumer that is merely
slow to read is left alone."""

from __future__ import annotations

import asyncio
import subprocess
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from services.broker import start_broker
from shared.hole_guard import HoleGuard, nothing_served_at

TOPIC = "hole.t"
TP = TopicPartition(TOPIC, 0)


async def _create(bootstrap: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(TOPIC, 1, 1)])
    finally:
        await admin.close()


async def _consumer(bootstrap: str) -> AIOKafkaConsumer:
    c = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest", fetch_max_wait_ms=100
    )
    await c.start()
    c.assign([TP])
    c.seek(TP, 0)
    return c


async def _until(what: str, done, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.05)


def _restart(proc: subprocess.Popen, bootstrap: str) -> subprocess.Popen:
    proc.kill()
    proc.wait()
    host, port = bootstrap.rsplit(":", 1)
    return start_broker(host, int(port), tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)[0]


def test_a_consumer_at_a_restarted_brokers_hole_reads_on():
    """The recipe (module docstring of shared/hole_guard.py): a producer with cached metadata
    writes one record to the topic the restarted broker does not have yet (acknowledged, offset 0),
    the topic is created (its watermark back to 0), and a batch of four is refused at offset 0
    (the record is there) while the watermark moves to 4. A consumer reads offset 0, then sits at 1
    below a high watermark of 4 that no produce will ever fill; with the guard it goes on to 4 and
    reads what is produced next."""
    proc, bootstrap = start_broker(tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def run() -> tuple[int, list[bytes], int]:
        nonlocal proc
        await _create(bootstrap)
        single = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
        batched = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=200)
        await single.start()
        await batched.start()
        await single.send_and_wait(TOPIC, b"before", partition=0)
        await batched.send_and_wait(TOPIC, b"before", partition=0)  # both hold the topic's metadata
        proc = _restart(proc, bootstrap)
        orphan = await single.send_and_wait(TOPIC, b"orphan", partition=0)  # no topic yet: stored anyway
        await _create(bootstrap)
        refused = [await batched.send(TOPIC, f"refused-{i}".encode(), partition=0) for i in range(4)]
        outcomes = await asyncio.gather(*refused, return_exceptions=True)
        assert all(isinstance(o, Exception) for o in outcomes), outcomes  # AlreadyExists at offset 0

        consumer = await _consumer(bootstrap)
        guard = HoleGuard(lambda: [consumer], wait_s=1.0)
        guard.arm()  # as the broker watch does once it has repaired a restart
        got: list[bytes] = []

        async def read() -> None:
            while True:
                for msgs in (await consumer.getmany(timeout_ms=200)).values():
                    got.extend(m.value for m in msgs)

        reader = asyncio.create_task(read())
        try:
            await _until("the orphan read", lambda: got == [b"orphan"])
            # The confirming probe: a stored record is found, the hole is not (session 8: a busy
            # tansu's empty answers over stored records made the guard skip them).
            assert not await nothing_served_at(consumer, TP, 0)
            assert await nothing_served_at(consumer, TP, 1)
            # A candidate the probe does not confirm stays where it is.
            asked: list[int] = []

            async def not_a_hole(_consumer, _tp, position: int) -> bool:
                asked.append(position)
                return False

            doubting = HoleGuard(lambda: [consumer], wait_s=1.0, confirm=not_a_hole)
            doubting.arm()
            deadline = time.monotonic() + 120
            while not asked:
                assert await doubting.check() == 0
                assert time.monotonic() < deadline, "the hole was never a candidate"
                await asyncio.sleep(0.1)
            assert asked == [1] and await consumer.position(TP) == 1
            guard.start()
            # Nothing else is produced: only the guard can move the consumer past the hole.
            deadline = time.monotonic() + 120
            while await consumer.position(TP) != 4:
                assert time.monotonic() < deadline, "the consumer stayed at the hole"
                await asyncio.sleep(0.05)
            assert guard.skipped == 1
            await single.send_and_wait(TOPIC, b"after", partition=0)
            await _until("the next record read", lambda: got == [b"orphan", b"after"])
            return orphan.offset, got, consumer.highwater(TP)
        finally:
            await guard.stop()
            reader.cancel()
            await consumer.stop()
            await single.stop()
            await batched.stop()

    try:
        orphan_offset, got, highwater = asyncio.run(run())
    finally:
        proc.kill()
        proc.wait()
    assert orphan_offset == 0 and highwater == 5  # 0 the orphan, 1-3 the hole, 4 "after"


def test_a_consumer_slow_to_read_is_not_moved(kafka_bootstrap):
    """Records fetched and waiting unread (the service busy elsewhere) are not a hole, however
    long they wait: the guard leaves the position where it is and every record is read."""

    async def run() -> tuple[int, list[bytes]]:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        await admin.create_topics([NewTopic("hole.slow", 1, 1)])
        await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=0)
        await producer.start()
        for i in range(3):
            await producer.send_and_wait("hole.slow", f"r{i}".encode(), partition=0)
        tp = TopicPartition("hole.slow", 0)
        consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False, fetch_max_wait_ms=100)
        await consumer.start()
        consumer.assign([tp])
        consumer.seek(tp, 0)
        guard = HoleGuard(lambda: [consumer], wait_s=0.5)
        guard.arm()
        try:
            # Not reading: the fetcher buffers the three records, the position stays at 0 while
            # the high watermark is 3, for six times the guard's wait, checked every 0.1 s.
            await _until("the records fetched", lambda: consumer.highwater(tp) == 3)
            checks = 0
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                checks += await guard.check()
                await asyncio.sleep(0.1)
            got = [m.value for msgs in (await consumer.getmany(timeout_ms=2000)).values() for m in msgs]
            return checks, got
        finally:
            await consumer.stop()
            await producer.stop()

    stepped, got = asyncio.run(run())
    assert stepped == 0 and got == [b"r0", b"r1", b"r2"]
