"""Read the records a restarted tansu hides behind a batch stored before its topic existed.

Why (docs/reliability.md, "The broker's minute, found"). After a restart the embedded broker
(tansu 0.6, in memory) stores a produce to a topic it does not have yet under the topic's name,
at offsets 0, 1, ... of a watermark that the topic's creation then resets to 0
(tansu-storage/src/dynostore.rs: `produce` advances the watermark by the batch's record count and
stores `records/<offset>.batch`; `create_topic` clears the watermark and keeps the objects). The
next produces are given offsets again from 0: one whose offset is a stored batch's is refused
(and re-sent by shared/produce_resend.py), but one whose offset falls *inside* a stored batch of
several records (aiokafka batches what a producer sends within its linger) is stored under its
own offset and acknowledged. A fetch lists every stored batch from the position up to the high
watermark, in offset order, each served with its stored offset as base: batch 0 with records
0-2, then batch 1 with record 1. aiokafka's fetcher skips any record below the offset it has
reached ("probably a compressed message set"), so record 1 of batch 1, the acknowledged one,
was never delivered. In `tandem chaos --faults broker` that record was the scheduler's
`Rerouted` for a recovery probe whose dispatch tansu had refused: the gateway never re-submitted
it and answered 503 after its 60 s first-event timeout, the broker fault's "62 s".

A second form of the same state: a stored batch that reaches past the high watermark (batch 0
with records 0-2 while the new topic's watermark is 1) carries the reader's position past every
offset the next produces will get, and tansu answers a fetch past its high watermark with
nothing (shared/hole_guard.py, "Past the end", catches it only if it looks before the watermark
has grown past the position).

What `TolerantPartitionRecords` does differently from aiokafka's `PartitionRecords`, only when an
answer shows one of these two signs (a later batch starting below where an earlier one ended, or
a batch ending past the answer's high watermark):
- it yields a later batch's records even when an earlier batch of the same answer covered their
  offsets (records below the position the fetch asked for are still skipped, as before);
- it leaves the position one past the last batch's *base* offset instead of past its last
  record: tansu lists batches by base offset, so the next fetch starts with the first batch this
  answer did not return (an answer cut short by its byte limit included) and skips none.
Every reader already drops what it has applied (by request id and attempt, token index, key), so
a record delivered twice costs nothing; one never delivered cost a minute. On Apache Kafka (and a
healthy tansu) batches of an answer are contiguous and end at or below the high watermark, so
neither sign appears and this class reads exactly as aiokafka's does. Read-committed consumers
(none here) keep aiokafka's code.

The high watermark of the answer is set by the fetcher on the partition's state just before it
builds the partition's records; `answering()` (entered by `QuietConsumer` around each answer,
shared/quiet_consumer.py) hands that state to the constructor. Without it (a plain consumer) only
the first sign is judged. `install()` swaps the class in aiokafka's fetcher module, once per
process, and logs a warning instead if this aiokafka is not built as expected.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator

from aiokafka.consumer import fetcher as _fetcher

log = logging.getLogger(__name__)

# The assignment whose fetch answer is being applied (set by `answering`); the records of a
# partition are built right after its high watermark is stored there.
_ANSWERING: contextvars.ContextVar = contextvars.ContextVar("tandem_fetch_answering", default=None)
_ORIGINAL = _fetcher.PartitionRecords


@contextlib.contextmanager
def answering(assignment) -> Iterator[None]:
    """While a fetch answer for `assignment` is applied: lets the records see its high watermark."""
    token = _ANSWERING.set(assignment)
    try:
        yield
    finally:
        _ANSWERING.reset(token)


class TolerantPartitionRecords(_ORIGINAL):
    """aiokafka's `PartitionRecords`, reading what a restarted tansu serves behind a stale batch
    (module doc)."""

    def __init__(self, tp, records, aborted_transactions, fetch_offset, *args) -> None:
        assignment = _ANSWERING.get()
        state = assignment.state_value(tp) if assignment is not None else None
        self.highwater: int | None = getattr(state, "highwater", None)
        self._asked = fetch_offset
        self.overlaps = 0  # records yielded although an earlier batch of the answer covered their offset
        super().__init__(tp, records, aborted_transactions, fetch_offset, *args)

    def _unpack_records(self):
        if self._isolation_level == _fetcher.READ_COMMITTED:
            yield from super()._unpack_records()
            return
        records, last_base, anomaly = self._records, None, False
        while records.has_next():
            batch = records.next_batch()
            if self._check_crcs and not batch.validate_crc():
                raise _fetcher.Errors.CorruptRecordException(f"Invalid CRC - {self._tp}")
            base = getattr(batch, "base_offset", None)
            if base is None:  # a legacy (v0/v1) batch: only aiokafka's own reading applies
                yield from self._as_aiokafka(batch)
                continue
            if base < self.next_fetch_offset and base >= self._asked:
                anomaly = True  # starts inside what an earlier batch of this answer covered
            last_base = base
            if not batch.is_control_batch:
                for record in batch:
                    if record.offset < self._asked:
                        continue  # below the position asked for: part of the batch holding it
                    if record.offset < self.next_fetch_offset:
                        self.overlaps += 1
                        yield self._consumer_record(self._tp, record)
                        continue
                    self.next_fetch_offset = record.offset + 1
                    yield self._consumer_record(self._tp, record)
            self.next_fetch_offset = max(self.next_fetch_offset, batch.next_offset)
        if self.highwater is not None and self.next_fetch_offset > self.highwater:
            anomaly = True  # a batch reaching past the high watermark (module doc)
        if anomaly and last_base is not None:
            self.next_fetch_offset = max(self._asked, last_base + 1)
            _log_once(self._tp, self._asked, last_base, self.highwater, self.overlaps)

    def _as_aiokafka(self, batch):
        for record in batch:
            if record.offset < self.next_fetch_offset:
                continue
            self.next_fetch_offset = record.offset + 1
            yield self._consumer_record(self._tp, record)
        self.next_fetch_offset = max(self.next_fetch_offset, batch.next_offset)


_logged: set[tuple] = set()


def _log_once(tp, asked: int, last_base: int, highwater: int | None, overlaps: int) -> None:
    key = (tp, asked, last_base)
    if key in _logged:
        return
    if len(_logged) > 10_000:  # a long-lived process: forget, at worst a repeated line
        _logged.clear()
    _logged.add(key)
    log.warning(
        "%s[%d]: batches stored before the topic existed overlap or pass the high watermark %s "
        "(a restarted broker, shared/stale_batches.py): read %d records hidden behind them; "
        "reading on from offset %d",
        tp.topic,
        tp.partition,
        highwater,
        overlaps,
        max(asked, last_base + 1),
    )


def _looks_as_expected() -> bool:
    cls = _ORIGINAL
    return all(hasattr(cls, name) for name in ("_unpack_records", "_consumer_record")) and hasattr(
        _fetcher, "READ_COMMITTED"
    )


def install() -> bool:
    """Use `TolerantPartitionRecords` for every consumer of this process; False (with a warning)
    when this aiokafka's fetcher is not the one this was written against (constraints.txt pins
    it): then a restarted tansu may hide records again, as before."""
    if _fetcher.PartitionRecords is TolerantPartitionRecords:
        return True
    if not _looks_as_expected():
        log.warning("aiokafka's fetcher is not as expected: records hidden by a restarted broker are not read")
        return False
    _fetcher.PartitionRecords = TolerantPartitionRecords
    return True
