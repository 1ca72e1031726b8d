"""Consumer lag from a consumer's own fetch state: records on its assigned partitions that it
has not yet handed to the service (the broker's last reported high-water mark minus the
consumer's position), summed per topic. No broker request: aiokafka learns the high-water mark
from every fetch response, so this is cheap enough to sample every housekeeping round.

The position is the one the consumer holds (`held_position`), never `consumer.position()`:
that one waits, asking the broker, while a partition has no valid position (a reset after a
broker restart), and the scheduler's housekeeping awaited it every pass (a candidate for a
restarted scheduler's 79 s of silence, tenth session). A partition without one is left out."""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer

from shared.hole_guard import held_position


def consumer_lag(consumer: AIOKafkaConsumer) -> dict[str, int]:
    """Topic -> records not yet read; a partition not fetched yet (no high-water mark) or without
    a valid position is left out."""
    lag: dict[str, int] = {}
    for tp in consumer.assignment():
        high, position = consumer.highwater(tp), held_position(consumer, tp)
        if high is None or position is None:
            continue
        lag[tp.topic] = lag.get(tp.topic, 0) + max(0, high - position)
    return lag
