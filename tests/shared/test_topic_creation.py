"""Topic creation at a service's start survives a broker that answers `RequestTimedOut` (a loaded
tansu does: it ended a gateway's start, and a `tandem chaos` run with it, in session 7).

The broker is real; the timed-out answer is injected into the admin client's first creation
request, since a real one cannot be had on cue."""

from __future__ import annotations

import asyncio

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import RequestTimedOutError

from shared.kafka import KafkaClient
from shared.settings import ServiceSettings
from shared.topics import TopicSpec


def test_a_timed_out_topic_creation_is_retried(kafka_bootstrap, monkeypatch):
    real_create = AIOKafkaAdminClient.create_topics
    answers: list[str] = []

    async def create_once_timed_out(self, new_topics, *args, **kwargs):
        if not answers:
            answers.append("timed out")
            raise RequestTimedOutError()
        answers.append("created")
        return await real_create(self, new_topics, *args, **kwargs)

    monkeypatch.setattr(AIOKafkaAdminClient, "create_topics", create_once_timed_out)
    spec = TopicSpec("topic-creation-retried", 3, "none")

    async def run() -> int:
        kafka = KafkaClient(ServiceSettings(kafka_bootstrap=kafka_bootstrap), "creation-test")
        try:
            await kafka.start([spec])
            admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
            await admin.start()
            try:
                described = await admin.describe_topics([spec.name])
            finally:
                await admin.close()
            return len(described[0]["partitions"])
        finally:
            await kafka.stop()

    assert asyncio.run(run()) == 3
    assert answers == ["timed out", "created"]
