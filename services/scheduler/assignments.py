"""Which request runs where, persisted to the compacted `scheduler.state` topic.

The table is the scheduler's memory of dispatched, unfinished requests. Every change is written
to Kafka (key = request id, tombstone on end), so a restarted scheduler reads the topic to its end
and resumes with the same table: requests already placed are not placed twice. Each record
carries its writer's lease term, so what a deposed scheduler wrote after its successor began is
dropped on replay. A tombstone has no value to carry it, so its term travels in a record header
(`term`, ASCII digits): a deposed scheduler's late tombstone would otherwise end an assignment of
its successor (the request then re-placed as unaccounted, possibly run twice from the tokens the
client has). A tombstone without the header (written before terms existed) still applies. A
header rather than a marker value: compaction deletes by a null value, and a header survives
until the tombstone itself is compacted away (after which the key is gone anyway).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

from shared.kafka import KafkaClient, read_to_end
from shared.records import decode_record, record_key
from shared.schemas.scheduler import Assignment

log = logging.getLogger(__name__)

TERM_HEADER = "term"  # the writer's lease term on a tombstone (ASCII digits)


class AssignmentTable:
    def __init__(self, kafka: KafkaClient, topic: str, writer_term: Callable[[], int] = lambda: 0) -> None:
        self._kafka = kafka
        self._topic = topic
        self._writer_term = writer_term  # this scheduler's lease term now (stamped on tombstones)
        self.by_request: dict[str, Assignment] = {}
        self.term = 0  # the highest lease term among the records applied
        self.stale = 0  # records dropped: written by a deposed scheduler after its successor's
        # In memory only (failures.py reads them): the request ids whose dispatch is being sent
        # (re-sends included), and where each acknowledged dispatch landed: (attempt, offset).
        self.sending: set[str] = set()
        self.landed: dict[str, tuple[int, int]] = {}

    async def load(self) -> None:
        """Rebuild from the state topic (last value per key wins; tombstones delete)."""
        consumer = await self._kafka.consumer(group=None)
        try:
            await self._kafka.assign_all(consumer, self._topic, from_end=False)
            await read_to_end(consumer, self._apply)
        finally:
            await consumer.stop()

    def _apply(self, m) -> None:
        """One state record: an assignment, or a tombstone ending one; a malformed one is skipped."""
        request_id = record_key(m)
        if request_id is None:
            return
        if m.value is None:
            term = tombstone_term(m)
            if term is not None and term < self.term:
                self.stale += 1
                return
            self.term = max(self.term, term or 0)
            self.by_request.pop(request_id, None)
            return
        a = decode_record(Assignment, m)
        if a is None:
            return
        if a.term < self.term:
            self.stale += 1
            return
        self.term = a.term
        self.by_request[request_id] = a

    def get(self, request_id: str) -> Assignment | None:
        return self.by_request.get(request_id)

    async def add_nowait(self, a: Assignment) -> asyncio.Future:
        """Record and queue the write; the returned future resolves on the broker's ack."""
        self.by_request[a.request_id] = a
        return await self._kafka.send_nowait(self._topic, a, key=a.request_id)

    def dispatched(self, a: Assignment, offset: int) -> None:
        """`a`'s dispatch was acknowledged at `offset` of its worker's dispatch topic."""
        if len(self.landed) > 2 * len(self.by_request) + 1000:  # entries of assignments dropped meanwhile
            self.landed = {k: v for k, v in self.landed.items() if k in self.by_request}
        self.landed[a.request_id] = (a.attempt, offset)

    async def remove(self, request_id: str) -> Assignment | None:
        self.landed.pop(request_id, None)
        a = self.by_request.pop(request_id, None)
        if a is not None:
            term = str(self._writer_term()).encode()
            await self._kafka.send(self._topic, None, key=request_id, headers=[(TERM_HEADER, term)])
        return a

    def on_worker(self, worker_id: str) -> list[Assignment]:
        return [a for a in self.by_request.values() if a.worker_id == worker_id]

    def counts(self) -> dict[tuple[str, str], int]:
        """(worker id, class) -> requests in flight."""
        return Counter((a.worker_id, a.req_class) for a in self.by_request.values())

    def older_than(self, seconds: float) -> list[Assignment]:
        cutoff = time.time() - seconds
        return [a for a in self.by_request.values() if a.assigned_at < cutoff]


def tombstone_term(m) -> int | None:
    """The writer's term on a tombstone, or None when it carries none (or an unreadable one)."""
    for name, value in m.headers or ():
        if name == TERM_HEADER:
            try:
                return int(value)
            except (TypeError, ValueError):
                log.warning("tombstone for %r with an unreadable term header %r: applied", m.key, value)
                return None
    return None
