"""Fences into a service's live-worker view, from the scheduler's compacted `scheduler.fences`.

The scheduler remembers every fence there (key: worker id, value: the highest epoch it declared
lost). Reading the topic from its start gives a service that starts late, or restarts, every
fence still in force, which `control` (where fences are also published, for workers) cannot:
a fence there is gone for a reader that was not listening. The queue and advisory services
follow it; the gateway reads fences from `control` as before.
"""

from __future__ import annotations

from aiokafka import ConsumerRecord

from shared.kafka import KafkaClient, tail
from shared.live_workers import LiveWorkers
from shared.records import decode_record
from shared.schemas.control import Fence


async def follow_fences(kafka: KafkaClient, topic: str, workers: LiveWorkers) -> None:
    """Apply every fence on `topic` to `workers`, from the start, forever."""
    consumer = await kafka.consumer(group=None)
    await kafka.assign_all(consumer, topic, from_end=False)

    def apply(m: ConsumerRecord) -> None:
        fence = decode_record(Fence, m)
        if fence is not None:
            workers.on_fence(fence.worker_id, fence.epoch)

    await tail(consumer, apply)
