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
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAlreadyExistsError

from shared.aio import within
from shared.doorbell import Doorbell, doorbell_directory
from shared.quiet_consumer import QuietConsumer
from shared.records import decode_record
from shared.schemas.base import WireModel
from shared.settings import ServiceSettings
from shared.topics import TopicSpec
from shared.tracing import KafkaHeaders

log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=WireModel)


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
            log.warning("%s failed (%s); retrying in %.1fs", what, exc, delay)
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

    async def send(
        self,
        topic: str,
        message: WireModel | None,
        *,
        key: str | None = None,
        partition: int | None = None,
        headers: KafkaHeaders | None = None,
    ) -> None:
        """Send and wait for the broker's ack (None = tombstone on a compacted topic). `headers`:
        trace context and send time (`shared/tracing.py`)."""
        value = None if message is None else message.encode()
        await self.producer.send_and_wait(
            topic, value, key=None if key is None else key.encode(), partition=partition, headers=headers
        )
        self._ring(topic)

    async def send_nowait(
        self,
        topic: str,
        message: WireModel,
        *,
        key: str | None = None,
        partition: int | None = None,
        headers: KafkaHeaders | None = None,
    ) -> asyncio.Future:
        """Queue a send; the returned future resolves on the ack (lets callers pipeline)."""
        ack = await self.producer.send(
            topic, message.encode(), key=None if key is None else key.encode(), partition=partition, headers=headers
        )
        if self.doorbell is not None:
            ack.add_done_callback(lambda f: f.cancelled() or f.exception() or self._ring(topic))
        return ack

    def _ring(self, topic: str) -> None:
        """Wake the quiet consumers of `topic` now that the broker has the record."""
        if self.doorbell is not None:
            self.doorbell.ring(topic)

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

        `hot`: on the request/token path. On a broker that cannot long-poll its fetches return
        after `kafka_fetch_wait_ms` while it is awake (others after 100 ms); on Apache Kafka every
        consumer long-polls (`kafka_long_poll_wait_ms`), which costs no latency there.
        `idle_poll_s`: the longest a sleeping consumer goes without looking by itself, for a
        reader that must not miss a record for longer than `kafka_idle_poll_ms` (a lease reader).
        """
        s = self.settings
        if s.kafka_long_poll:
            cls, extra = AIOKafkaConsumer, {"fetch_max_wait_ms": s.kafka_long_poll_wait_ms}
        else:
            wait_ms = s.kafka_fetch_wait_ms if hot else 100
            # Two fetch waits: a fetch in flight when the last record or ring came may have read
            # the partition before that record existed (tansu answers with what it read at the
            # start), so the window must see one more fetch answer, sent after it.
            awake_s = max(s.kafka_awake_ms, 2 * wait_ms) / 1000
            poll_s = (
                s.kafka_idle_poll_ms / 1000 if idle_poll_s is None else min(idle_poll_s, s.kafka_idle_poll_ms / 1000)
            )
            extra = {"fetch_max_wait_ms": wait_ms, "awake_s": awake_s, "idle_poll_s": poll_s}
            cls = QuietConsumer
        c = cls(
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
            **extra,
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

    def _listen(self, consumer: AIOKafkaConsumer, topic: str) -> None:
        if isinstance(consumer, QuietConsumer) and self.doorbell is not None:
            self.doorbell.listen(topic, consumer.wake)

    async def owned_consumer(self, *topics: str, group: str, hot: bool = False) -> AIOKafkaConsumer:
        """All partitions of topics only this process reads (a worker's `dispatch.<id>`; the
        active scheduler's request topics, which its lease makes its own), with commits under
        `group` but no group membership: nothing to join, so no rebalance.

        A subscribed consumer waits for the coordinator's join round (about 3 s on tansu, which
        delays the first assignment) before its first fetch, all of which is start-up time for a
        worker whose model is already loaded. Assigned directly it fetches at once, from the
        group's committed offsets (what it had accepted before a restart), or from the start
        of the topic. What membership would add, fencing off a second process with the same
        worker id, it does not give anyway within its session timeout; a worker id must be
        unique (the scheduler treats two as one worker).
        """
        c = await self.consumer(group=group, subscribe=False, hot=hot)
        tps = []
        for topic in topics:
            parts = await with_backoff(f"metadata {topic}", lambda t=topic: _partitions(c, t))
            tps += [TopicPartition(topic, p) for p in parts]
        c.assign(tps)  # positions: committed, else earliest
        for topic in topics:
            self._listen(c, topic)
        return c

    async def assign_all(
        self, consumer: AIOKafkaConsumer, topic: str, *, from_end: bool, partitions: Sequence[int] | None = None
    ) -> list[TopicPartition]:
        """Group-less reading of a whole topic (or given partitions), from its start or its end."""
        if partitions is None:
            parts = await with_backoff(f"metadata {topic}", lambda: _partitions(consumer, topic))
        else:
            parts = list(partitions)
        tps = [TopicPartition(topic, p) for p in parts]
        consumer.assign(tps)
        self._listen(consumer, topic)
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


async def fetch_decoded(consumer: AIOKafkaConsumer, cls: type[M], timeout_ms: int = 1000) -> list[M]:
    """The next batch of messages decoded as `cls`; malformed ones are logged and skipped
    (`shared/records.py`)."""
    out = []
    for msgs in (await consumer.getmany(timeout_ms=timeout_ms)).values():
        for m in msgs:
            msg = decode_record(cls, m)
            if msg is not None:
                out.append(msg)
    return out


async def tail(
    consumer: AIOKafkaConsumer, on_message: Callable[[ConsumerRecord], None], timeout_ms: int = 1000
) -> None:
    """Apply every message as it arrives, forever (after `read_to_end` rebuilt a compacted topic)."""
    while True:
        for msgs in (await consumer.getmany(timeout_ms=timeout_ms)).values():
            for m in msgs:
                apply_safely(on_message, m)


async def read_to_end(
    consumer: AIOKafkaConsumer, on_message: Callable[[ConsumerRecord], None], *, stall_s: float = 10.0
) -> None:
    """Apply every message up to the current end of the consumer's assigned partitions (rebuilding
    state from a compacted topic); the consumer then tails from there.

    Gives up on reaching the end after `stall_s` without a record: tansu, right after a restart,
    acknowledges records at offsets it can never serve (a produce that raced the topic's
    creation), so its reported end can stay out of reach, and a restarted scheduler waited on it
    forever (found by `tandem chaos`). What could be read has been applied; the gap is logged."""
    end = await consumer.end_offsets(list(consumer.assignment()))
    last_record = time.monotonic()
    while not await _caught_up(consumer, end):
        if time.monotonic() - last_record > stall_s:
            behind = {f"{tp.topic}[{tp.partition}]": (await consumer.position(tp), e) for tp, e in end.items()}
            log.warning("replay stalled below the reported end (position, end): %s; going on", behind)
            return
        for msgs in (await consumer.getmany(timeout_ms=200)).values():
            last_record = time.monotonic()
            for m in msgs:
                apply_safely(on_message, m)


def apply_safely(on_message: Callable[[ConsumerRecord], None], m: ConsumerRecord) -> None:
    """One record through `on_message`; an exception is logged and the loop goes on (one bad
    record, or a bug its contents trigger, must not stop a service reading its topic)."""
    try:
        on_message(m)
    except Exception:  # noqa: BLE001
        log.exception("record at %s[%d]@%d not applied; skipped", m.topic, m.partition, m.offset)


async def _caught_up(consumer: AIOKafkaConsumer, end_offsets: dict) -> bool:
    for tp, end in end_offsets.items():
        if await consumer.position(tp) < end:
            return False
    return True


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


class OffsetTracker:
    """Manual-commit bookkeeping when messages finish out of order.

    The committable offset of a partition is the lowest offset still being worked on (or one past
    the last seen): committing it never skips unfinished work, so a restart redelivers exactly
    the unfinished messages (and consumers drop the finished ones they see again by id).
    """

    def __init__(self) -> None:
        self._pending: dict[TopicPartition, set[int]] = {}
        self._next: dict[TopicPartition, int] = {}

    def started(self, tp: TopicPartition, offset: int) -> None:
        self._pending.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def done(self, tp: TopicPartition, offset: int) -> None:
        self._pending.get(tp, set()).discard(offset)

    def committable(self) -> dict[TopicPartition, int]:
        out = {}
        for tp, nxt in self._next.items():
            pending = self._pending.get(tp)
            out[tp] = min(pending) if pending else nxt
        return out
