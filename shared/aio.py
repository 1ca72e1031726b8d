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

`run_on_event` is the services' "wake, then do one round" loop (placement, heartbeat follow-ups,
session-location publishing): one place owns its rule that a wake-up during a round is a request
for one more round, and that a failed round is logged, never the end of the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NoReturn, TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], seconds: float) -> T:
    """`await aw`, or `TimeoutError` after `seconds` (module docstring: not `asyncio.wait_for`)."""
    async with asyncio.timeout(seconds):
        return await aw


async def run_on_event(
    event: asyncio.Event, round_: Callable[[], Awaitable[object]], *, failed: str, logger: logging.Logger
) -> NoReturn:
    """Run `round_` each time `event` is set, until cancelled.

    The event is cleared *before* the round, so a set that arrives while the round runs (state
    changed after the round read it) gives exactly one more round, and sets that arrive together
    coalesce into one. An exception from a round is logged as `failed` with its traceback and the
    loop waits for the next set, which retries: a broker away for a moment must not end placement
    or heartbeat follow-ups for the life of the process. Cancellation ends the loop (it is not an
    `Exception`)."""
    while True:
        await event.wait()
        event.clear()
        try:
            await round_()
        except Exception:  # noqa: BLE001 (see the docstring: the next set retries)
            logger.warning(failed, exc_info=True)
