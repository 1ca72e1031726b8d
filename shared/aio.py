"""asyncio helpers: a bounded wait that a cancellation always ends.

Why not `asyncio.wait_for`: on Python 3.11 (this project's floor) it swallows a cancellation that
arrives when the awaited thing has just completed (CPython gh-86296, fixed in 3.12): it returns
the result instead of raising `CancelledError`. A service loop (`while True: ... await
wait_for(event.wait(), t)`) cancelled at stop in that moment runs on, and the `stop()` that
awaits it waits forever. That is how a scheduler hung at stop in the test suite: its lease
consumer's idle wait (`QuietConsumer._watch`) was woken by a doorbell ring (the queue and
advisory services releasing their leases on the same topic as they stopped too) just as it was
cancelled. `asyncio.timeout` (3.11) counts cancellations and has no such race, so every bounded
wait in the services uses it, directly or through `within`; ruff bans `asyncio.wait_for` outside
the tests (pyproject.toml, TID251).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], seconds: float) -> T:
    """`await aw`, or `TimeoutError` after `seconds` (module docstring: not `asyncio.wait_for`)."""
    async with asyncio.timeout(seconds):
        return await aw
