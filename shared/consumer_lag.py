"""Consumer lag from a consumer's own fetch state: records on its assigned partitions that it
has not yet handed to the service (the broker's last reported high-water mark minus the
consumer's position), summed per topic. No broker request: aiokafka learns the high-water mark
from every fetch response, so this is cheap enough to sample every housekeeping round."""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer


async def consumer_lag(consumer: AIOKafkaConsumer) -> dict[str, int]:
    """Topic -> records not yet read; a partition not fetched yet (no high-water mark) is left out."""
    lag: dict[str, int] = {}
    for tp in consumer.assignment():
        high = consumer.highwater(tp)
        if high is None:
            continue
        lag[tp.topic] = lag.get(tp.topic, 0) + max(0, high - await consumer.position(tp))
    return lag
