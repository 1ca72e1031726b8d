"""A reader behind on a long partition catches up at any fetch wait (real tansu; issue 21).

tansu answers a fetch with what it read by the fetch's deadline. Finding a position deep in a
partition of one-record batches (the token path's results partition after a few thousand
tokens) takes it longer than 1 ms: a 1 ms fetch at offset 4,700 of 5,000 such batches came
back empty 205 times in 300 ms, each answer showing the high-water mark 300 above the position;
a 2 ms fetch read 52 records, 5 ms all 300. With the sixth session's 1 ms token-path wait the
gateway's results reader fell behind that way on a burst, slept with the records unread, and
the fuzzing test's requests were answered 503 after 60 s (shared/quiet_consumer.py, "Catching
up").
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import AIOKafkaProducer

from shared.kafka import KafkaClient
from shared.quiet_consumer import QuietConsumer
from shared.schemas.control import Cancel, ControlEnvelope
from shared.settings import ServiceSettings
from shared.topics import TopicSpec
from tests.shared.waiting import until

pytestmark = pytest.mark.timeout(300)

LONG_PARTITION = 6000  # one-record batches before the reader's position
BURST = 300  # then written while it sleeps, without a ring


def _record(i: int) -> bytes:
    return ControlEnvelope(message=Cancel(request_id=f"r{i}")).encode()


async def _one_record_batches(bootstrap: str, topic: str, first: int, count: int) -> None:
    """`count` records, each its own batch (a batch size below one record forces that, as the
    worker's one-message-per-step sends do), with a header like the worker's send time."""
    raw = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0, max_batch_size=16)
    await raw.start()
    try:
        acks = [
            await raw.send(topic, _record(i), partition=0, headers=[("sent-ns", b"1795545229000000000")])
            for i in range(first, first + count)
        ]
        await asyncio.gather(*acks)
    finally:
        await raw.stop()


@pytest.mark.parametrize("wait_ms", [1, 2])
def test_a_reader_behind_on_a_long_partition_reads_everything_and_sleeps_only_when_caught_up(kafka_bootstrap, wait_ms):
    settings = ServiceSettings(kafka_bootstrap=kafka_bootstrap, kafka_fetch_wait_ms=wait_ms, kafka_idle_poll_ms=60_000)

    async def run() -> None:
        topic = f"qc-catch-up-{wait_ms}"
        kafka = KafkaClient(settings, "qc")
        await kafka.start([TopicSpec(topic, 1, "none")])
        await _one_record_batches(kafka_bootstrap, topic, 0, LONG_PARTITION)
        reader = await kafka.consumer(group=None, hot=True)
        assert isinstance(reader, QuietConsumer)
        (tp,) = await kafka.assign_all(reader, topic, from_end=True)
        await until(lambda: reader.sleeping, "the idle reader to sleep")
        # Every time it falls asleep: where it was and what the broker's last answer showed.
        asleep_at: list[tuple[int, int | None]] = []
        fall_asleep = reader._fall_asleep  # noqa: SLF001 (the event under test)

        def recorded() -> None:
            state = reader._subscription.subscription.assignment.state_value(tp)  # noqa: SLF001
            asleep_at.append((state.position, state.highwater))
            fall_asleep()

        reader._fall_asleep = recorded  # noqa: SLF001

        # A burst it is not rung for, then one record it is: it must read all of them.
        await _one_record_batches(kafka_bootstrap, topic, LONG_PARTITION, BURST)
        await kafka.send(topic, ControlEnvelope(message=Cancel(request_id="rung")), partition=0)
        got: list[str] = []
        deadline = time.monotonic() + 120  # a safety net: it takes about a second
        while "rung" not in got:
            assert time.monotonic() < deadline, f"stalled after {len(got)} of {BURST + 1} records"
            for msgs in (await reader.getmany(timeout_ms=1000)).values():
                got += [ControlEnvelope.decode(m.value).message.request_id for m in msgs]
        assert got == [f"r{i}" for i in range(LONG_PARTITION, LONG_PARTITION + BURST)] + ["rung"]
        await until(lambda: reader.sleeping, "the reader to sleep once caught up")
        end = LONG_PARTITION + BURST + 1
        assert asleep_at and all(pos == hw == end for pos, hw in asleep_at), asleep_at
        # Caught up: the answers that brought the burst put back the configured wait, whatever
        # empty answers had grown it to (`starved_answers` of them).
        assert reader._fetcher._fetch_max_wait_ms == wait_ms, reader.starved_answers  # noqa: SLF001
        await kafka.stop()

    asyncio.run(run())
