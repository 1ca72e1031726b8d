"""Waits shared by the Kafka-layer tests: poll a condition, or read control-message ids, until
what the test needs has happened. The bounds are safety nets, never the property under test."""

from __future__ import annotations

import asyncio
import time

from shared.schemas.control import ControlEnvelope


async def until(cond, what: str, timeout_s: float = 120.0, poll_s: float = 0.005) -> None:
    """Wait for `cond()` (a state of the consumer under test); fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(poll_s)


async def read_ids(consumer, n: int, timeout_ms: int = 500) -> list[str]:
    """The request ids of the next `n` control messages `consumer` reads."""
    got: list[str] = []
    while len(got) < n:
        for msgs in (await consumer.getmany(timeout_ms=timeout_ms)).values():
            got += [ControlEnvelope.decode(m.value).message.request_id for m in msgs]
    return got
