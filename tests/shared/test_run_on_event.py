"""`shared.aio.run_on_event`: the services' wake-then-one-round loop (placement, heartbeat
follow-ups, session locations). Every wait here is for an event, never a fixed time."""

from __future__ import annotations

import asyncio
import logging

import pytest

from shared.aio import run_on_event, within

log = logging.getLogger("test_run_on_event")


async def _until(predicate, what: str) -> None:
    async with asyncio.timeout(10):
        while not predicate():
            await asyncio.sleep(0)
    assert predicate(), what


@pytest.mark.asyncio
async def test_a_set_during_a_round_gives_exactly_one_more_round():
    event = asyncio.Event()
    started, release = asyncio.Event(), asyncio.Event()
    rounds = 0

    async def round_() -> None:
        nonlocal rounds
        rounds += 1
        if rounds == 1:
            started.set()
            await release.wait()

    loop = asyncio.create_task(run_on_event(event, round_, failed="x", logger=log))
    event.set()
    await within(started.wait(), 10)
    for _ in range(3):  # three sets while the first round runs coalesce into one more round
        event.set()
    release.set()
    await _until(lambda: rounds == 2, "the second round ran")
    for _ in range(50):  # and no third: the loop is back waiting on a cleared event
        await asyncio.sleep(0)
    assert rounds == 2
    assert not event.is_set()
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop


@pytest.mark.asyncio
async def test_a_failed_round_is_logged_and_the_next_set_retries(caplog):
    event = asyncio.Event()
    rounds = 0

    async def round_() -> None:
        nonlocal rounds
        rounds += 1
        if rounds == 1:
            raise RuntimeError("broker away")

    caplog.set_level(logging.WARNING, logger=log.name)
    loop = asyncio.create_task(run_on_event(event, round_, failed="round failed", logger=log))
    event.set()
    await _until(lambda: rounds == 1 and not event.is_set() and caplog.records, "the failing round ran")
    assert not loop.done()
    record = caplog.records[0]
    assert record.getMessage() == "round failed" and record.exc_info[0] is RuntimeError
    event.set()
    await _until(lambda: rounds == 2, "the loop survived the failure and ran again")
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop


@pytest.mark.asyncio
async def test_cancel_during_a_round_ends_the_loop():
    event, started = asyncio.Event(), asyncio.Event()

    async def round_() -> None:
        started.set()
        await asyncio.Event().wait()  # never ends by itself

    loop = asyncio.create_task(run_on_event(event, round_, failed="x", logger=log))
    event.set()
    await within(started.wait(), 10)
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop
