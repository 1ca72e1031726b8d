"""`tandem topics create|list`: the topic catalogue on a Kafka cluster (Compose's init step)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "topics",
        help="create or list Tandem's Kafka topics",
        description="Create every topic in the catalogue (shared/topics.py), or list them.",
    )
    p.add_argument("action", choices=["create", "list"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    return asyncio.run(_run(args.action))


async def _run(action: str) -> int:
    from shared.kafka import KafkaClient
    from shared.settings import ServiceSettings
    from shared.topics import Topics

    settings = ServiceSettings()
    topics = Topics(settings.topic_prefix).static()
    kafka = KafkaClient(settings, "tandem-topics")
    if action == "create":
        await kafka.ensure_topics(topics)
    for t in topics:
        print(f"{t.name:<32} partitions={t.partitions:<3} key={t.key}{' (compacted)' if t.compacted else ''}")
    return 0
