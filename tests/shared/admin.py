"""Topic set-up shared by the Kafka-layer tests that restart or read a broker directly."""

from __future__ import annotations

from aiokafka.admin import AIOKafkaAdminClient, NewTopic


async def create_topic(bootstrap: str, topic: str) -> None:
    """A one-partition topic on the broker at `bootstrap` (a test's own, before it produces)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
