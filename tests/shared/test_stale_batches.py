"""Records a restarted tansu hides behind a batch stored before its topic existed are read
(shared/stale_batches.py; the broker fault's 62 s in `tandem chaos`, docs/reliability.md).

First the reading rule alone, on fetch answers built by hand (base offsets as tansu serves them):
a healthy answer reads exactly as aiokafka's own code does, an overlapping one yields every
record and leaves the position where the next unread batch starts. Then the state itself on a
real tansu, made as a restart makes it: a producer with cached metadata writes a three-record
batch to the restarted broker before the topic exists, the topic is created (watermark back to
0), and a record sent next is refused at 0, re-sent and acknowledged at 1, inside the stale
batch's offsets. A reader from the start must read it, and the one after it."""

from __future__ import annotations

import asyncio
import struct
import subprocess

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords

from services.broker import start_broker
from shared import stale_batches
from shared.kafka import KafkaClient
from shared.schemas.control import Cancel, ControlEnvelope
from shared.settings import ServiceSettings
from tests.shared.admin import create_topic

TP = TopicPartition("t", 0)


def _batch(base: int, values: list[bytes]) -> bytes:
    """One v2 record batch whose records are `base`, `base + 1`, ... (as tansu serves a stored
    batch: its base offset rewritten to the offset it is stored under)."""
    builder = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, -1, 1 << 20)
    for i, v in enumerate(values):
        builder.append(i, timestamp=None, key=None, value=v, headers=[])
    raw = bytearray(builder.build())
    raw[0:8] = struct.pack(">q", base)
    return bytes(raw)


def _cancel(request_id: str) -> ControlEnvelope:
    return ControlEnvelope(message=Cancel(request_id=request_id))


class _State:
    def __init__(self, highwater: int | None) -> None:
        self.highwater = highwater


class _Assignment:
    def __init__(self, highwater: int | None) -> None:
        self._state = _State(highwater)

    def state_value(self, tp):
        return self._state


def _read(cls, answer: bytes, fetch_offset: int, highwater: int | None = None) -> tuple[list[tuple[int, bytes]], int]:
    """(offset, value) of every record `cls` yields for `answer`, and the position after it."""
    with stale_batches.answering(_Assignment(highwater)):
        records = cls(TP, MemoryRecords(answer), None, fetch_offset, None, None, True, 0)
    got = [(r.offset, r.value) for r in records]
    return got, records.next_fetch_offset


def test_a_healthy_answer_reads_as_aiokafka_reads_it():
    answer = _batch(5, [b"a", b"b"]) + _batch(7, [b"c"]) + _batch(8, [b"d", b"e", b"f"])
    for asked in (5, 6):  # at a batch's start, and inside it (Kafka serves the batch holding the offset)
        ours = _read(stale_batches.TolerantPartitionRecords, answer, asked, highwater=11)
        assert ours == _read(stale_batches._ORIGINAL, answer, asked)  # noqa: SLF001 (aiokafka's own class)
    assert [o for o, _ in ours[0]] == [6, 7, 8, 9, 10] and ours[1] == 11


def test_a_batch_inside_a_stale_one_is_read_and_the_next_fetch_starts_after_it():
    # tansu after a restart: batch 0 (three records stored before the topic existed), then the
    # records acknowledged at 1 and 2 after it was created; high watermark 3
    answer = _batch(0, [b"stale-0", b"stale-1", b"stale-2"]) + _batch(1, [b"kept"]) + _batch(2, [b"next"])
    theirs, _ = _read(stale_batches._ORIGINAL, answer, 0)  # noqa: SLF001
    assert b"kept" not in [v for _, v in theirs]  # aiokafka skips it: below the offset it had reached
    got, position = _read(stale_batches.TolerantPartitionRecords, answer, 0, highwater=3)
    assert [v for _, v in got] == [b"stale-0", b"stale-1", b"stale-2", b"kept", b"next"]
    assert position == 3  # one past the last batch's base: nothing listed above it was skipped


def test_a_stale_batch_past_the_high_watermark_leaves_the_position_below_it():
    # the stale batch alone (records 0-2) while the new topic's watermark is 1: the next records
    # will land at 1 and 2, so the reader must fetch from 1, not 3
    got, position = _read(stale_batches.TolerantPartitionRecords, _batch(0, [b"s0", b"s1", b"s2"]), 0, highwater=1)
    assert [v for _, v in got] == [b"s0", b"s1", b"s2"] and position == 1
    # without a known high watermark (a plain consumer) only an overlap is a sign
    got, position = _read(stale_batches.TolerantPartitionRecords, _batch(0, [b"s0", b"s1", b"s2"]), 0)
    assert position == 3


def test_a_reader_from_the_start_reads_what_lands_inside_a_stale_batch():
    topic = "stale.t"
    proc, bootstrap = start_broker(tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    host, port = bootstrap.rsplit(":", 1)

    async def run() -> tuple[list[int], list[str]]:
        nonlocal proc
        await create_topic(bootstrap, topic)
        stale = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
        await stale.start()
        await stale.send_and_wait(topic, b"before", partition=0)  # the topic's metadata, cached
        proc.kill()
        proc.wait()
        proc = start_broker(host, int(port), tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)[0]
        batch = stale.create_batch()
        for i in range(3):
            batch.append(key=None, value=_cancel(f"stale-{i}").encode(), timestamp=None)
        await (await stale.send_batch(batch, topic, partition=0))  # no topic yet: stored anyway, at 0-2
        await stale.stop()
        await create_topic(bootstrap, topic)  # the watermark back to 0, the stale batch kept
        kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap), "stale-test")
        await kafka.start()
        try:
            landed = []
            for rid in ("kept", "next"):  # refused at 0 (the stale batch's slot), then 1 and 2
                landed.append((await kafka.send(topic, _cancel(rid), partition=0)).offset)
            reader = await kafka.consumer(group=None)
            await kafka.assign_all(reader, topic, from_end=False)
            read: list[str] = []
            async with asyncio.timeout(120):  # a safety net: the records are there at once
                while "next" not in read:
                    for msgs in (await reader.getmany(timeout_ms=500)).values():
                        read += [ControlEnvelope.decode(m.value).message.request_id for m in msgs]
        finally:
            await kafka.stop()
        return landed, read

    try:
        landed, read = asyncio.run(run())
    finally:
        proc.kill()
        proc.wait()
    assert landed == [1, 2]  # inside the stale batch's offsets 0-2: the state of the chaos run
    assert read == ["stale-0", "stale-1", "stale-2", "kept", "next"]
