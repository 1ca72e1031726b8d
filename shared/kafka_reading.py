"""Reading helpers over aiokafka consumers: decode a batch, tail a topic, replay a compacted one
to its end, and the manual-commit bookkeeping for messages that finish out of order.

Split out of `shared/kafka.py` (which keeps `KafkaClient` and re-exports these names, so
`from shared.kafka import read_to_end` still works): reading records is one concern, the client
that opens producers and consumers another.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from shared.records import decode_record
from shared.schemas.base import WireModel

log = logging.getLogger(__name__)
M = TypeVar("M", bound=WireModel)


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


async def skip_commits_past_the_end(consumer: AIOKafkaConsumer, tps: list[TopicPartition], group: str) -> int:
    """Read from the start every partition whose committed offset lies past its end; returns how
    many. Such an offset was committed from a broker that has since lost its data.

    How it gets there: a commit in flight when the broker dies is retried by aiokafka (unknown
    topic is a retriable error) until the restarted broker has the topic again, and then it lands
    there, with the old broker's offsets (seen in `tandem chaos --ha --faults broker`: a standby
    scheduler that took over after the restart started its request consumer at the deposed
    active's offsets 4-11 on topics of 0-1 records, and placed nothing for minutes). Apache Kafka
    answers a fetch past the end with OffsetOutOfRange and the consumer resets (to the earliest
    offset here); tansu answers with nothing, so the consumer would wait until the partition grows
    past the stale offset. All records of the new topic are newer than the restart, so reading
    them all is what the reset would do. A stale offset *below* the new end cannot be told from a
    true one; docs/reliability.md names that gap."""
    ends = await consumer.end_offsets(tps)
    stale = 0
    for tp in tps:
        committed = await consumer.committed(tp)
        if committed is not None and committed > ends[tp]:
            log.warning(
                "%s[%d]: group %s committed offset %d, past the partition's end %d (committed from a broker "
                "that lost its data); reading it from the start",
                tp.topic,
                tp.partition,
                group,
                committed,
                ends[tp],
            )
            consumer.seek(tp, 0)
            stale += 1
    return stale
