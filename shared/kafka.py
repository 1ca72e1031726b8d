"""A small layer over aiokafka: start-up with backoff, topic creation, typed send, consumers
with manual commits, and a clean stop that flushes.

Producers use `acks=all` and are not idempotent: the embedded tansu broker fails idempotent
producers, so no service asks for them (`KafkaClient(idempotence=True)` would, on a broker
that supports them). Every consumer is idempotent instead: messages carry ids and readers drop
what they have already applied.

Fetching depends on the broker (`TANDEM_KAFKA_LONG_POLL`): Apache Kafka holds a fetch until data
arrives, so consumers are plain aiokafka ones with a long wait. The embedded tansu broker
answers only at the fetch deadline, so there consumers are `QuietConsumer`s: short waits while
records flow, no fetch at all when idle, woken by the doorbell every send here rings
(`shared/doorbell.py`, docs/services.md "Fetch waits").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAlreadyExistsError
from aiokafka.structs import RecordMetadata

from shared.aio import within
from shared.doorbell import Doorbell, doorbell_directory
from shared.fetch_policy import fetch_policy
from shared.kafka_reading import (
    OffsetTracker,
    apply_safely,
    fetch_decoded,
    read_to_end,
    skip_commits_past_the_end,
    tail,
)
from shared.produce_resend import NO_RESEND, RESEND, ResendPolicy, with_resend
from shared.quiet_consumer import QuietConsumer, ring_payload
from shared.schemas.base import WireModel
from shared.settings import ServiceSettings
from shared.topics import TopicSpec
from shared.tracing import KafkaHeaders

# The reading helpers live in shared/kafka_reading.py; importable from here as before.
__all__ = [
    "NO_RESEND",
    "RESEND",
    "KafkaClient",
    "OffsetTracker",
    "apply_safely",
    "fetch_decoded",
    "read_to_end",
    "tail",
    "with_backoff",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


async def with_backoff(
    what: str, fn: Callable[[], Awaitable[T]], *, attempts: int = 30, first_delay: float = 0.1, max_delay: float = 2.0
) -> T:
    """Retry `fn` on connection errors with exponential backoff (the broker may still be starting)."""
    delay = first_delay
    for i in range(attempts):
        try:
            return await fn()
        except (KafkaConnectionError, KafkaError, OSError) as exc:
            if i == attempts - 1:
                raise
            log.warning("%s failed (%r); retrying in %.1fs", what, exc, delay)  # repr: TimeoutError() has no str
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)
    raise AssertionError("unreachable")


class KafkaClient:
    """One producer plus the consumers a service opens; `stop()` flushes and closes them all."""

    def __init__(self, settings: ServiceSettings, client_id: str, *, idempotence: bool = False) -> None:
        self.settings = settings
        self.client_id = client_id
        self._idempotence = idempotence
        self.producer: AIOKafkaProducer | None = None
        self._consumers: list[AIOKafkaConsumer] = []
        # Every topic this client created or was told it relies on, by name: what a broker-restart
        # repair recreates with the right partition count (shared/broker_watch.py).
        self.catalogue: dict[str, TopicSpec] = {}
        # The catalogue topics this client created (or found) itself, not only remembered: only
        # those missing is a sign the broker restarted. A remembered topic belongs to another
        # service, which may not have created it yet or may have deleted it (a worker's dispatch
        # topic, remembered by the scheduler when the worker's first heartbeat arrives).
        self.ensured: set[str] = set()
        # Only for a broker that cannot long-poll; made on first use (it needs the event loop).
        self._doorbell: Doorbell | None = None

    @property
    def doorbell(self) -> Doorbell | None:
        if self.settings.kafka_long_poll:
            return None
        if self._doorbell is None:
            self._doorbell = Doorbell(doorbell_directory(self.bootstrap))
        return self._doorbell

    @property
    def bootstrap(self) -> str:
        return self.settings.kafka_bootstrap

    async def start(self, topics: Sequence[TopicSpec] = ()) -> None:
        await self.ensure_topics(topics)
        self.producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            client_id=self.client_id,
            acks="all",
            linger_ms=0,
            enable_idempotence=self._idempotence,
            request_timeout_ms=10000,
        )
        await with_backoff("producer start", self.producer.start)

    async def ensure_topics(self, topics: Sequence[TopicSpec], *, own: bool = True) -> None:
        """Create missing topics (creating an existing one is a no-op). `own=False` (a repair
        that recreates remembered topics too) leaves them out of `ensured`."""
        self.remember(*topics)
        if own:
            self.ensured.update(t.name for t in topics)
        if not topics:
            return
        # Retried as a whole, with a new admin client each time: a loaded tansu answers the
        # listing or the creation with `RequestTimedOut`, which ended a gateway's start (and a
        # `tandem chaos` run with it) while the connect alone was retried.
        await with_backoff("topic creation", lambda: self._create_missing(topics))

    async def _create_missing(self, topics: Sequence[TopicSpec]) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, client_id=f"{self.client_id}-admin")
        await with_backoff("admin connect", admin.start)
        try:
            existing = set(await admin.list_topics())
            new = [_new_topic(t) for t in topics if t.name not in existing]
            if new:
                try:
                    await admin.create_topics(new)
                except TopicAlreadyExistsError:
                    pass  # another service won the race
        finally:
            await admin.close()

    def remember(self, *topics: TopicSpec) -> None:
        """Add topics to the catalogue without creating them (one this service produces to that
        another creates, such as a worker's dispatch topic for the scheduler)."""
        for t in topics:
            self.catalogue[t.name] = t

    async def refresh_metadata(self) -> None:
        """Re-read topic metadata now in the producer and every consumer (after topics were
        recreated with other partition counts; aiokafka refreshes only every 5 minutes)."""
        clients = [self.producer.client] if self.producer is not None else []
        clients += [c._client for c in self.live_consumers()]  # noqa: SLF001 (aiokafka has no public refresh)
        results = await asyncio.gather(
            *(within(client.force_metadata_update(), 3) for client in clients), return_exceptions=True
        )
        for r in results:
            if isinstance(r, BaseException):  # the next metadata refresh or send retries it
                log.warning("metadata refresh failed: %r", r)

    def live_consumers(self) -> list[AIOKafkaConsumer]:
        """The consumers made by this client and not stopped by their user (a replay reader
        stopped after its replay never answers again)."""
        return [c for c in self._consumers if not getattr(c, "_closed", False)]  # noqa: SLF001

    def rewind_consumers(self) -> None:
        """Move every consumer to offset 0 of each partition it holds: after a broker lost its
        data, all records of its topics are new (readers drop what they already applied by id).
        A position below a partition's start falls back to its auto reset (earliest)."""
        for c in self._consumers:
            if getattr(c, "_closed", False):  # noqa: SLF001 (stopped by its user)
                continue
            try:
                for tp in c.assignment():
                    c.seek(tp, 0)
            except Exception:  # noqa: BLE001 (a group mid-rebalance: its new assignment starts from committed offsets, which are gone, so from the beginning anyway)
                log.warning("consumer not rewound", exc_info=True)
            if isinstance(c, QuietConsumer):
                c.wake()

    def _single_partition(self, topic: str, partition: int | None) -> int | None:
        """Partition 0 for a one-partition catalogue topic, whatever the key: a producer whose
        metadata saw a restarted tansu's auto-created multi-partition topic keeps that count after
        a broker watch re-created it with one, and its keyed records went where nobody reads
        (session 8's lease claims; dispatch and `be.capacity` are keyed too)."""
        spec = self.catalogue.get(topic)
        if partition is None and spec is not None and spec.partitions == 1:
            return 0
        return partition

    async def send(
        self,
        topic: str,
        message: WireModel | None,
        *,
        key: str | None = None,
        partition: int | None = None,
        headers: KafkaHeaders | None = None,
        resend: ResendPolicy = RESEND,
    ) -> RecordMetadata:
        """Send and wait for the broker's ack (None = tombstone on a compacted topic). `headers`:
        trace context and send time (`shared/tracing.py`). A record the broker refuses is sent
        again per `resend` (`shared/produce_resend.py`: periodic reports pass `NO_RESEND`).
        Returns where the record landed."""
        value = None if message is None else message.encode()
        raw_key = None if key is None else key.encode()
        partition = self._single_partition(topic, partition)
        landed = await with_resend(
            f"record to {topic}",
            lambda: self.producer.send_and_wait(topic, value, key=raw_key, partition=partition, headers=headers),
            resend,
        )
        self._ring(topic, landed)
        return landed

    async def send_nowait(
        self,
        topic: str,
        message: WireModel,
        *,
        key: str | None = None,
        partition: int | None = None,
        headers: KafkaHeaders | None = None,
        resend: ResendPolicy = RESEND,
    ) -> asyncio.Future:
        """Queue a send; the returned future resolves on the ack (lets callers pipeline). A
        refused record is sent again per `resend` before the future resolves; the re-send is
        not ordered with sends queued after this one (`shared/produce_resend.py`)."""
        value, raw_key = message.encode(), None if key is None else key.encode()
        partition = self._single_partition(topic, partition)
        ack = await self.producer.send(topic, value, key=raw_key, partition=partition, headers=headers)
        if resend.attempts:
            ack = asyncio.ensure_future(
                with_resend(
                    f"record to {topic}",
                    lambda: self.producer.send_and_wait(
                        topic, value, key=raw_key, partition=partition, headers=headers
                    ),
                    resend,
                    first_ack=ack,
                )
            )
        if self.doorbell is not None:
            ack.add_done_callback(lambda f: f.cancelled() or f.exception() or self._ring(topic, f.result()))
        return ack

    def _ring(self, topic: str, landed: RecordMetadata | None = None) -> None:
        """Wake the quiet consumers of `topic` now that the broker has the record, telling them
        where it landed (they sleep again once they have read it)."""
        if self.doorbell is not None:
            self.doorbell.ring(topic, ring_payload(landed))

    def ring(self, bell: str, landed: RecordMetadata | None = None) -> None:
        """Ring a named bell, after a send it announces: for readers that listen on a bell of
        their own instead of their topic's (`assign_all(bell=...)`, a lease reader woken only by
        its role's records of the shared `leases` topic)."""
        self._ring(bell, landed)

    async def consumer(
        self,
        *topics: str,
        group: str | None,
        from_latest: bool = False,
        hot: bool = False,
        subscribe: bool = True,
        idle_poll_s: float | None = None,
        **kwargs,
    ) -> AIOKafkaConsumer:
        """A started consumer. With a group: subscribed, manual commits. Without: call `assign_all`.

        `hot`: on the request/token path. How it fetches (its class, waits, sleeping) is the
        broker's `fetch_policy` (`shared/fetch_policy.py`).
        `idle_poll_s`: the longest a sleeping consumer goes without looking by itself, for a
        reader that must not miss a record for longer than `kafka_idle_poll_ms` (a lease reader).
        """
        policy = fetch_policy(self.settings, hot=hot, idle_poll_s=idle_poll_s)
        c = policy.consumer_class(
            *topics if group and subscribe else (),
            bootstrap_servers=self.bootstrap,
            client_id=self.client_id,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="latest" if from_latest else "earliest",
            # Short group timers: a replaced member (restart after a crash) is evicted in seconds.
            session_timeout_ms=6000,
            heartbeat_interval_ms=1000,
            rebalance_timeout_ms=3000,
            **policy.options,
            **kwargs,
        )
        try:
            await with_backoff("consumer start", c.start)
        except BaseException:
            # A start that failed or was cancelled (a service stopped while its broker is down)
            # still opened a client: close it, or the garbage collector reports an "Unclosed
            # AIOKafkaConsumer" at exit (stop() only closes the consumers that started).
            await c.stop()
            raise
        self._consumers.append(c)
        if group and subscribe:
            for topic in topics:
                self._listen(c, topic)
        return c

    def _listen(self, consumer: AIOKafkaConsumer, topic: str, bell: str | None = None) -> None:
        if isinstance(consumer, QuietConsumer) and self.doorbell is not None:
            self.doorbell.listen(bell or topic, lambda payloads: consumer.wake(topic, payloads))

    async def owned_consumer(self, *topics: str, group: str, hot: bool = False) -> AIOKafkaConsumer:
        """All partitions of topics only this process reads (a worker's `dispatch.<id>`; the
        active scheduler's request topics, which its lease makes its own), with commits under
        `group` but no group membership: nothing to join, so no rebalance.

        A subscribed consumer waits for the coordinator's join round (about 3 s on tansu, which
        delays the first assignment) before its first fetch, all of which is start-up time for a
        worker whose model is already loaded. Assigned directly it fetches at once, from the
        group's committed offsets (what it had accepted before a restart), or from the start
        of the topic; a committed offset past a partition's end (left by a broker that lost its
        data) is ignored (`skip_commits_past_the_end`). What membership would add, fencing off a
        second process with the same worker id, it does not give anyway within its session
        timeout; a worker id must be unique (the scheduler treats two as one worker).
        """
        c = await self.consumer(group=group, subscribe=False, hot=hot)
        tps = []
        for topic in topics:
            parts = await with_backoff(f"metadata {topic}", lambda t=topic: _partitions(c, t))
            tps += [TopicPartition(topic, p) for p in parts]
        c.assign(tps)  # positions: committed, else earliest
        await with_backoff(f"committed offsets {group}", lambda: skip_commits_past_the_end(c, tps, group))
        for topic in topics:
            self._listen(c, topic)
        return c

    async def assign_all(
        self,
        consumer: AIOKafkaConsumer,
        topic: str,
        *,
        from_end: bool,
        partitions: Sequence[int] | None = None,
        bell: str | None = None,
    ) -> list[TopicPartition]:
        """Group-less reading of a whole topic (or given partitions), from its start or its end.
        `bell`: wake the (quiet) consumer on that bell instead of the topic's (`ring`)."""
        if partitions is None:
            parts = await with_backoff(f"metadata {topic}", lambda: _partitions(consumer, topic))
        else:
            parts = list(partitions)
        tps = [TopicPartition(topic, p) for p in parts]
        consumer.assign(tps)
        self._listen(consumer, topic, bell)
        if from_end:
            await consumer.seek_to_end(*tps)
        else:
            await consumer.seek_to_beginning(*tps)
        return tps

    async def stop(self) -> None:
        for c in self._consumers:
            try:
                await c.stop()
            except asyncio.CancelledError:
                # aiokafka's fetcher close re-raises the cancellation of a fetch it cancelled
                # mid-retry (the broker is gone): not ours unless this task is being cancelled
                if asyncio.current_task().cancelling():
                    raise
                log.warning("consumer stop: a fetch retry was cancelled (broker unreachable)")
            except Exception:  # noqa: BLE001 (best effort on shutdown)
                log.exception("consumer stop")
        self._consumers.clear()
        if self.producer is not None:
            try:
                await self.producer.flush()
                await self.producer.stop()
            except Exception:  # noqa: BLE001
                log.exception("producer stop")
            self.producer = None
        if self._doorbell is not None:
            self._doorbell.close()
            self._doorbell = None


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> list[int]:
    parts = consumer.partitions_for_topic(topic)
    if not parts:
        await consumer._client.force_metadata_update()  # noqa: SLF001 (aiokafka has no public refresh)
        parts = consumer.partitions_for_topic(topic)
    if not parts:
        raise KafkaConnectionError(f"no metadata for topic {topic}")
    return sorted(parts)


def _new_topic(t: TopicSpec) -> NewTopic:
    configs = {"cleanup.policy": "compact"} if t.compacted else {}
    return NewTopic(t.name, t.partitions, 1, topic_configs=configs)
