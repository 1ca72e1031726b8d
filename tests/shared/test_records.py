"""Malformed records are skipped with one rate-limited log line, never raised (shared/records.py),
and client JSON is parsed with a depth bound (shared/openai_api/json_input.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from shared.openai_api import json_input
from shared.records import LOG_INTERVAL_S, MalformedRecords, decode_record, record_key
from shared.schemas.telemetry import Heartbeat


@dataclass
class Record:  # the fields of aiokafka's ConsumerRecord the decoder reads
    value: bytes | None
    key: bytes | None = b"k"
    topic: str = "t.heartbeats"
    partition: int = 0
    offset: int = 7


def _heartbeat(**kw) -> Heartbeat:
    fields = dict(
        worker_id="w",
        model="m",
        max_model_len=64,
        dispatch_topic="t.dispatch.w",
        started_at=1.0,
        sent_at=2.0,
    )
    return Heartbeat(**{**fields, **kw})


@pytest.mark.parametrize(
    "value",
    [
        b"{not json",
        b"\xff\xfe",
        b"",
        b"[]",
        b"{}",
        b"[" * 100_000 + b"]" * 100_000,  # deeper than any parser should recurse
        _heartbeat().model_copy(update={"schema_version": 99}).encode(),  # a newer major version
        b'{"x": "' + b"a" * (4 << 20) + b'"}',  # huge
        None,  # a tombstone where none belongs
    ],
    ids=["bad-json", "not-utf8", "empty", "array", "missing-fields", "deep", "newer-version", "huge", "tombstone"],
)
def test_malformed_values_decode_to_none_and_are_logged(value, caplog):
    caplog.set_level(logging.WARNING, logger="shared.records")
    assert decode_record(Heartbeat, Record(value, topic=f"t.{id(value)}")) is None
    [line] = [r.getMessage() for r in caplog.records]
    assert "malformed record skipped" in line and "partition 0 offset 7" in line
    assert len(line) < 1000  # a huge record does not become a huge log line


def test_valid_records_and_expected_tombstones_decode():
    hb = _heartbeat()
    assert decode_record(Heartbeat, Record(hb.encode())) == hb
    assert decode_record(Heartbeat, Record(None), tombstone_ok=True) is None


def test_keys_that_are_missing_or_not_utf8_are_malformed(caplog):
    caplog.set_level(logging.WARNING, logger="shared.records")
    assert record_key(Record(b"{}", key=b"s1")) == "s1"
    assert record_key(Record(b"{}", key=None, topic="t.a")) is None
    assert record_key(Record(b"{}", key=b"\xff", topic="t.b")) is None
    assert len(caplog.records) == 2


def test_log_lines_are_rate_limited_per_topic(caplog):
    caplog.set_level(logging.WARNING, logger="shared.records")
    now = [0.0]
    malformed = MalformedRecords(clock=lambda: now[0])
    for _ in range(1000):
        malformed.skip(Record(b"x"), "Heartbeat", "bad")
    malformed.skip(Record(b"x", topic="t.other"), "Heartbeat", "bad")
    assert malformed.skipped == {"t.heartbeats": 1000, "t.other": 1}
    assert len(caplog.records) == 2  # one per topic, not one per record
    now[0] += LOG_INTERVAL_S
    malformed.skip(Record(b"x"), "Heartbeat", "bad")
    assert "999 more skipped" in caplog.records[-1].getMessage()


def test_client_json_is_bounded_and_strict():
    assert json_input.loads(b'{"a": [1, 2]}') == {"a": [1, 2]}
    for bad in (b"[" * 200_000 + b"]" * 200_000, b"NaN", b'{"t": Infinity}', b"{} x", b"\xff"):
        with pytest.raises(ValueError):
            json_input.loads(bad)
