"""The queue service's work-loop clock (services/queue/wakeup.py): events, deadlines, safety poll."""

from __future__ import annotations

import asyncio
import time

from services.queue.wakeup import TickClock


def test_first_wait_is_immediate_then_waits_for_an_event():
    async def run() -> None:
        clock = TickClock(idle_s=3600)
        await asyncio.wait_for(clock.wait(), 5)  # start-up: work from before the start
        waiting = asyncio.create_task(clock.wait())
        await asyncio.sleep(0.05)
        assert not waiting.done()  # nothing happened: no tick
        clock.wake()
        await asyncio.wait_for(waiting, 5)

    asyncio.run(run())


def test_the_earliest_deadline_ends_the_wait_and_a_tick_clears_them():
    async def run() -> None:
        clock = TickClock(idle_s=3600)
        await clock.wait()
        clock.wake_at(time.time() + 600)
        clock.wake_at(time.time() + 0.1)  # a batch that expires sooner
        assert clock.timeout_s() <= 0.1
        t0 = time.monotonic()
        await asyncio.wait_for(clock.wait(), 30)
        assert time.monotonic() - t0 >= 0.09  # not before its deadline
        clock.clear_deadlines()
        assert clock.timeout_s() == 3600
        clock.wake_at(time.time() - 5)  # already past: run at once
        assert clock.timeout_s() == 0

    asyncio.run(run())


def test_with_nothing_to_do_it_waits_the_safety_poll():
    async def run() -> None:
        clock = TickClock(idle_s=0.1)
        await clock.wait()
        t0 = time.monotonic()
        await asyncio.wait_for(clock.wait(), 30)
        assert time.monotonic() - t0 >= 0.09

    asyncio.run(run())
