"""The early sleep off the token path never misses a record published while it sleeps (real
tansu; issue 21, seventh session).

A reader off the token path sleeps as soon as it has read what it was rung for
(shared/quiet_consumer.py). At the sixth session's merge the suite stalled with this on and it was
switched off as a suspect, without proof. Here its awake window and its own looks are an hour
apart, so only a ring can wake it: a record it slept through would stall the reader, which the
test reports instead of waiting an hour. Records come while it sleeps, in the very turn it falls
asleep, and from a producer racing its fetches, on four partitions, from two clients. The same
for a reader on the token path with `kafka_hot_settle` (its 2 ms fetch wait; eighth session).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from shared.kafka import KafkaClient
from shared.quiet_consumer import QuietConsumer
from shared.schemas.control import Cancel, ControlEnvelope
from shared.settings import ServiceSettings
from shared.topics import TopicSpec
from tests.shared.waiting import until

pytestmark = pytest.mark.timeout(300)
PARTITIONS = 4
HOUR_MS = 3_600_000


def _envelope(rid: str) -> ControlEnvelope:
    return ControlEnvelope(message=Cancel(request_id=rid))


class _Reader:
    """Reads the early sleeper into `got` (request ids) in the background."""

    def __init__(self, consumer: QuietConsumer) -> None:
        self.consumer = consumer
        self.got: list[str] = []
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            for msgs in (await self.consumer.getmany(timeout_ms=1000)).values():
                self.got += [ControlEnvelope.decode(m.value).message.request_id for m in msgs]

    async def has(self, rids: list[str], what: str) -> None:
        unread = f"{what}: unread {sorted(set(rids) - set(self.got))}"
        await until(lambda: set(rids) <= set(self.got), unread, poll_s=0.002)

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


@pytest.mark.parametrize("hot", [False, True], ids=["cold", "hot-settle"])
def test_an_early_sleeper_reads_every_record_published_while_it_sleeps(kafka_bootstrap, hot):
    settings = ServiceSettings(
        kafka_bootstrap=kafka_bootstrap, kafka_awake_ms=HOUR_MS, kafka_idle_poll_ms=HOUR_MS, kafka_hot_settle=hot
    )
    rng = random.Random(21)

    async def run() -> None:
        topic = f"qc-early-sleep-{'hot' if hot else 'cold'}"
        readers_client, producers = KafkaClient(settings, "reader"), [KafkaClient(settings, f"p{i}") for i in (0, 1)]
        await readers_client.start([TopicSpec(topic, PARTITIONS, "none")])
        for p in producers:
            await p.start()
        consumer = await readers_client.consumer(group=None, hot=hot)
        assert isinstance(consumer, QuietConsumer) and consumer._settle_early  # noqa: SLF001
        await readers_client.assign_all(consumer, topic, from_end=True)
        reader = _Reader(consumer)
        n = 0

        async def publish(count: int) -> list[str]:
            nonlocal n
            rids = [f"r{n + k}" for k in range(count)]
            n += count
            await asyncio.gather(
                *(rng.choice(producers).send(topic, _envelope(r), partition=rng.randrange(PARTITIONS)) for r in rids)
            )
            return rids

        # It sleeps only on a rung record's answer (its window is an hour).
        await reader.has(await publish(1), "the first record")
        await until(lambda: consumer.sleeping, "the reader to sleep on the rung record's answer", poll_s=0.002)

        # 1. Published while it sleeps: read, and it sleeps again.
        for i in range(20):
            await reader.has(await publish(rng.randint(1, 3)), f"round {i} published while asleep")
            await until(lambda: consumer.sleeping, f"the reader to sleep again after round {i}", poll_s=0.002)

        # 2. Published in the very turn it falls asleep (from its settle).
        fall_asleep, sent_in_settle = consumer._fall_asleep, []  # noqa: SLF001

        def and_publish() -> None:
            fall_asleep()
            if len(sent_in_settle) < 20:
                sent_in_settle.append(asyncio.ensure_future(publish(1)))

        consumer._fall_asleep = and_publish  # noqa: SLF001
        await reader.has(await publish(1), "the record that starts the settles")
        await until(lambda: len(sent_in_settle) == 20, "20 settles, each publishing a record", poll_s=0.002)
        rids = [r for f in await asyncio.gather(*sent_in_settle) for r in f]
        await reader.has(rids, "records published as it fell asleep")
        consumer._fall_asleep = fall_asleep  # noqa: SLF001

        # 3. A producer racing its fetches and settles: every record read.
        racing: list[str] = []
        for _ in range(150):
            racing += await publish(1)
            await asyncio.sleep(rng.uniform(0, 0.004))
        await reader.has(racing, "records published while it read and slept")
        assert sorted(reader.got, key=lambda r: int(r[1:])) == [f"r{i}" for i in range(n)]  # each once
        await reader.stop()
        for c in (readers_client, *producers):
            await c.stop()

    asyncio.run(run())
