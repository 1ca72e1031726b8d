"""A reader carried past its partition's end by a restarted broker reads again from the start
(shared/hole_guard.py, "Past the end"; the broker-restart results stall, docs/reliability.md).

The state is made on a real tansu the way the stall's logs show it: a reader has read records
that tansu keeps under a topic's name when the topic is created again (here by deleting and
creating it, which resets its watermark to 0 and keeps the records, as a restart's auto-creation
does), so its position is above the new high watermark, and the next records are acknowledged
below it. Without the guard the reader never sees them (tansu answers a fetch past the end with
nothing, not `OffsetOutOfRange`)."""

from __future__ import annotations

import asyncio
import time
import uuid

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from shared.hole_guard import HoleGuard
from shared.quiet_consumer import QuietConsumer


async def _until(what: str, done, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.05)


async def _recreate(bootstrap: str, topic: str, *, delete: bool) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        if delete:
            await admin.delete_topics([topic])
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()


def test_a_sleeping_reader_past_the_end_is_rewound_and_reads_what_lands_below(kafka_bootstrap):
    topic = f"past.{uuid.uuid4().hex[:8]}"
    tp = TopicPartition(topic, 0)

    async def run() -> tuple[list[bytes], list[int], int]:
        await _recreate(kafka_bootstrap, topic, delete=False)
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=0)
        await producer.start()
        # the slow safety look (30 s) is beyond the wait below: only a wake-up makes it fetch
        reader = QuietConsumer(
            bootstrap_servers=kafka_bootstrap,
            enable_auto_commit=False,
            fetch_max_wait_ms=20,
            awake_s=0.2,
            idle_poll_s=30.0,
        )
        await reader.start()
        reader.assign([tp])
        reader.seek(tp, 0)
        got: list[bytes] = []

        async def read() -> None:
            while True:
                for msgs in (await reader.getmany(timeout_ms=200)).values():
                    got.extend(m.value for m in msgs)

        reading = asyncio.create_task(read())
        guard = HoleGuard(lambda: [reader], wait_s=1.0)
        try:
            for i in range(8):
                await producer.send_and_wait(topic, f"early-{i}".encode(), partition=0)
            await _until("the early records read", lambda: len(got) == 8)
            await _recreate(kafka_bootstrap, topic, delete=True)  # watermark back to 0
            guard.arm()  # as the broker watch does once it has repaired a restart
            landed = [(await producer.send_and_wait(topic, f"new-{i}".encode(), partition=0)).offset for i in range(3)]
            reader.wake()  # as the producers' ring does
            # the reader's answer at its position shows the high watermark below it
            await _until("an answer past the end", lambda: (reader.highwater(tp) or 0) == 3)
            assert await reader.position(tp) == 8
            guard.start()
            await _until("the new records read", lambda: got[8:] == [b"new-0", b"new-1", b"new-2"])
            return got, landed, guard.rewound
        finally:
            await guard.stop()
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            await reader.stop()
            await producer.stop()

    got, landed, rewound = asyncio.run(run())
    assert landed == [0, 1, 2]  # below the reader's position 8: the stall's state
    assert rewound == 1


def test_a_reader_at_its_end_is_left_alone(kafka_bootstrap):
    """A position equal to the high watermark (a reader that has read everything) is no sign:
    the armed guard does not move it, and the next record is read once, in order."""
    topic = f"past.{uuid.uuid4().hex[:8]}"
    tp = TopicPartition(topic, 0)

    async def run() -> tuple[list[bytes], int]:
        await _recreate(kafka_bootstrap, topic, delete=False)
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=0)
        await producer.start()
        reader = QuietConsumer(
            bootstrap_servers=kafka_bootstrap,
            enable_auto_commit=False,
            fetch_max_wait_ms=20,
            awake_s=0.2,
            idle_poll_s=1.0,
        )
        await reader.start()
        reader.assign([tp])
        reader.seek(tp, 0)
        guard = HoleGuard(lambda: [reader], wait_s=1.0)
        guard.arm()
        got: list[bytes] = []
        try:
            for i in range(3):
                await producer.send_and_wait(topic, f"r{i}".encode(), partition=0)
            while len(got) < 3:
                for msgs in (await reader.getmany(timeout_ms=200)).values():
                    got.extend(m.value for m in msgs)
                await guard.check()
            await _until("an answer at the end", lambda: reader.last_poll_timestamp(tp) is not None)
            for _ in range(5):
                await guard.check()
            await producer.send_and_wait(topic, b"r3", partition=0)
            reader.wake()
            while len(got) < 4:
                for msgs in (await reader.getmany(timeout_ms=200)).values():
                    got.extend(m.value for m in msgs)
            return got, guard.rewound
        finally:
            await reader.stop()
            await producer.stop()

    got, rewound = asyncio.run(run())
    assert got == [b"r0", b"r1", b"r2", b"r3"] and rewound == 0
