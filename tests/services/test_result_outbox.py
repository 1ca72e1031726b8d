"""The worker's result outbox through the real broker: a gateway partition receives a request's
deltas in the order they were put, also when sends pile up behind a full producer batch (what a
slow broker on a loaded machine causes)."""

from __future__ import annotations

import asyncio
import uuid

from services.worker.outbox import ResultOutbox
from shared.kafka import KafkaClient, fetch_decoded
from shared.schemas.results import Accepted, Delta, ResultBatch
from shared.settings import ServiceSettings
from shared.topics import Topics

N_DELTAS = 300
PARTITION = 3


async def _put_and_read(bootstrap: str) -> list[int]:
    topics = Topics(f"outbox-{uuid.uuid4().hex[:8]}")
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap), "test-outbox")
    await kafka.start(topics.static())
    try:
        outbox = ResultOutbox(kafka, topics.results.name, "w")
        # One delta per event-loop turn, each a 6 KB message: a 16 KB producer batch holds two,
        # so further sends wait for it to drain, as they do behind a slow broker.
        for i in range(N_DELTAS):
            outbox.put(PARTITION, Delta(request_id="r", index=i, token_ids=[i], text="x" * 6000))
            await asyncio.sleep(0)
        await outbox.drain()
        consumer = await kafka.consumer(group=None)
        await kafka.assign_all(consumer, topics.results.name, from_end=False, partitions=[PARTITION])
        indexes: list[int] = []
        while len(indexes) < N_DELTAS:
            for batch in await fetch_decoded(consumer, ResultBatch):
                indexes += [e.index for e in batch.events]
        return indexes
    finally:
        await kafka.stop()


def test_deltas_reach_the_partition_in_the_order_they_were_put(kafka_bootstrap):
    indexes = asyncio.run(asyncio.wait_for(_put_and_read(kafka_bootstrap), 120))
    assert indexes == list(range(N_DELTAS))


async def _held_and_read(bootstrap: str) -> list[list[str]]:
    """An Accepted put held, then its first delta; then an Accepted whose delta never comes."""
    topics = Topics(f"outbox-{uuid.uuid4().hex[:8]}")
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap), "test-outbox")
    await kafka.start(topics.static())
    try:
        outbox = ResultOutbox(kafka, topics.results.name, "w")
        outbox.put_held(PARTITION, Accepted(request_id="a", worker_id="w", prompt_tokens=1), hold_s=60.0)
        await asyncio.sleep(0)  # a later event-loop turn, as the engine's first step is
        outbox.put(PARTITION, Delta(request_id="a", index=0, token_ids=[1], text="x"))
        await outbox.drain()
        outbox.put_held(PARTITION, Accepted(request_id="b", worker_id="w", prompt_tokens=1), hold_s=0.05)
        consumer = await kafka.consumer(group=None)
        await kafka.assign_all(consumer, topics.results.name, from_end=False, partitions=[PARTITION])
        batches: list[list[str]] = []
        while len(batches) < 2:  # the second batch comes only once its hold has passed
            for batch in await fetch_decoded(consumer, ResultBatch):
                batches.append([f"{e.type}:{e.request_id}" for e in batch.events])
        return batches
    finally:
        await kafka.stop()


def test_a_held_accepted_leaves_with_the_first_delta_or_alone_after_its_hold(kafka_bootstrap):
    batches = asyncio.run(asyncio.wait_for(_held_and_read(kafka_bootstrap), 120))
    assert batches == [["accepted:a", "delta:a"], ["accepted:b"]]
