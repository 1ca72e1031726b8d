"""Malformed Kafka records: decoded or skipped, never fatal to a consumer loop.

Anything can land on a topic: bad JSON, a newer `schema_version`, a huge or empty payload, a
tombstone where none belongs, a record whose key is not UTF-8. Every consumer loop decodes
through `decode_record` (or `fetch_decoded`/`tail` in `shared/kafka.py`, which use it): a record
that does not decode is logged with its topic, partition, offset and size, counted, and skipped.

Skipped, not dead-lettered (decision): a record no reader can decode is a producer bug, and
no consumer could ever process a copy of it either. Kafka's retention already keeps the
original bytes at the logged offset, where any Kafka tool can fetch them; copying them to a
`<topic>.dlq` would double the bytes, add a producer to every consumer, and add a failure
mode (the dead-letter write failing) to the path that must not fail.

Logging is rate-limited per topic (one line per `LOG_INTERVAL_S`, with how many were skipped
since), so a flood of garbage cannot turn into a flood of log lines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from shared.schemas.base import WireModel

log = logging.getLogger(__name__)
M = TypeVar("M", bound=WireModel)
LOG_INTERVAL_S = 1.0
_REASON_CHARS = 300  # a pydantic error quotes the input: a huge record must not become a huge log line


class MalformedRecords:
    """Per-topic counts of skipped records and the rate limit of their log lines."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.skipped: dict[str, int] = {}  # topic -> records skipped since start
        self._last_log: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def skip(self, record: Any, what: str, reason: str) -> None:
        topic = getattr(record, "topic", "?")
        self.skipped[topic] = self.skipped.get(topic, 0) + 1
        now = self._clock()
        if now - self._last_log.get(topic, float("-inf")) < LOG_INTERVAL_S:
            self._unlogged[topic] = self._unlogged.get(topic, 0) + 1
            return
        self._last_log[topic] = now
        since = self._unlogged.pop(topic, 0)
        value = getattr(record, "value", None)
        log.warning(
            "malformed record skipped: topic %s partition %s offset %s (%s bytes) is not a valid %s: %s%s",
            topic,
            getattr(record, "partition", "?"),
            getattr(record, "offset", "?"),
            "no value" if value is None else len(value),
            what,
            reason[:_REASON_CHARS].replace("\n", " "),
            f" ({since} more skipped on this topic since the last report)" if since else "",
        )


# One per process: every consumer of a service reports into the same counts and rate limits.
MALFORMED = MalformedRecords()


def decode_record(cls: type[M], record: Any, *, tombstone_ok: bool = False) -> M | None:
    """`record.value` as `cls`, or None when the record is malformed (logged and counted).

    `tombstone_ok`: a None value is expected (a compacted topic's delete marker) and returns None
    silently; elsewhere it is malformed.
    """
    value = record.value
    if value is None:
        if not tombstone_ok:
            MALFORMED.skip(record, cls.__name__, "a tombstone (no value) on a topic that has none")
        return None
    try:
        return cls.decode(value)
    except ValueError as exc:  # pydantic's ValidationError included; also a newer schema_version
        MALFORMED.skip(record, cls.__name__, str(exc))
        return None


def record_key(record: Any) -> str | None:
    """The record's key as text, or None when it has none or it is not UTF-8 (logged and counted)."""
    key = record.key
    if key is None:
        MALFORMED.skip(record, "keyed record", "no key")
        return None
    try:
        return key.decode()
    except UnicodeDecodeError as exc:
        MALFORMED.skip(record, "keyed record", f"key is not UTF-8: {exc}")
        return None
