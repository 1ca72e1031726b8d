"""When the queue service's work loop runs next: at once on an event, at the next deadline, or
after a slow safety poll; never on a short timer while nothing happens.

The work loop (`QueueService.tick`) reads the database: five queries, a few ms of CPU. Run every
0.2 s it was the largest cost of an idle stack (issue 21). Everything it acts on is either an
event some loop of the service sees, or a time it can compute:

| work | what wakes it |
|---|---|
| validate a new batch, handle a cancel | the gateway's `BatchNotice` on `batches` (`wake`) |
| release queued items | a finished item (room in the budget); a capacity report with room while items may wait |
| finalise a batch | its last item finished (`wake` from the results loop) |
| expire a batch | its `expires_at` (`wake_at`, set by each tick from the open batches) |
| validate after start-up | one worker timeout after start (`wake_at`: the live workers' models are known by then) |

The safety poll (`TANDEM_IDLE_TICK_S`, 5 s) covers what no event announces: a notice lost with a
broker restart, a gateway of an older release, a second queue service's changes to the shared
database. Decision: 5 s, because batches run for minutes to hours (OpenAI's window is 24 h) and a
start-up delay of seconds is invisible there, while each poll costs the database a round of
queries.
"""

from __future__ import annotations

import asyncio
import time


class TickClock:
    """`wait()` returns when `wake()` was called, the earliest `wake_at` time has come, or
    `idle_s` passed since the wait began. Deadlines are wall-clock times (`time.time()`, what the
    database stores), kept until `clear_deadlines()` (each tick sets the ones it still needs).
    The first wait returns at once: a service that starts has work from before (items re-queued
    after a crash, batches created while it was down)."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._event = asyncio.Event()
        self._event.set()
        self._deadline: float | None = None

    def wake(self) -> None:
        self._event.set()

    def wake_at(self, when: float) -> None:
        self._deadline = when if self._deadline is None else min(self._deadline, when)

    def clear_deadlines(self) -> None:
        self._deadline = None

    def timeout_s(self) -> float:
        """How long the next wait may last with no event."""
        if self._deadline is None:
            return self.idle_s
        return max(0.0, min(self.idle_s, self._deadline - time.time()))

    async def wait(self) -> None:
        try:
            async with asyncio.timeout(self.timeout_s()):  # not wait_for: see shared/aio.py
                await self._event.wait()
        except TimeoutError:
            pass
        self._event.clear()
