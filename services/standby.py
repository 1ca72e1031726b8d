"""Active/standby for a service that may run doubled (scheduler, queue, advisory).

Every instance starts as a standby: it joins its role's election (`shared/lease.py`) and runs
nothing else. Once it holds the lease it runs the service's active part (`activate(term)`, the
start-up a single instance used to do), and stays active until it stops or is deposed. A
deposed instance exits at once with `DEPOSED_EXIT` (no clean stop: that would commit offsets
or write state as if it were still active); a supervisor restarts it as a standby.

A single instance is the same thing with nobody to compete: it claims the lease at start (at
once on a fresh topic or after a clean stop, after `lease_s` when its crashed predecessor's
lease must run out first).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable

from shared.kafka import KafkaClient
from shared.lease import LeaseKeeper, instance_name

log = logging.getLogger(__name__)
DEPOSED_EXIT = 75  # EX_TEMPFAIL: "try again", for a supervisor that restarts its children


def exit_deposed() -> None:
    """Leave now, without running anything else (the lease says another instance is active)."""
    _exit_now(DEPOSED_EXIT)


def _exit_now(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ActiveStandby:
    def __init__(self, kafka: KafkaClient, topic: str, role: str, service_id: str, lease_s: float) -> None:
        self.role = role
        self.keeper = LeaseKeeper(kafka, topic, role, instance_name(service_id), lease_s, on_deposed=exit_deposed)
        self._activation: asyncio.Task | None = None
        self._acting = False  # what `is_active` last answered (its changes are logged)

    @property
    def term(self) -> int:
        """The term this instance holds (stamp it on what it produces); 0 before it is active."""
        return self.keeper.active_term or 0

    def is_active(self) -> bool:
        """Check right before acting: False once the lease's window ran out (a long pause).
        A change is logged: an active that stops acting because its renewals are not read back
        was silent before (a scheduler placed and re-routed nothing for 79 s in a busy `tandem
        chaos` run, session 10, and its log could not say whether this was why)."""
        acting = self.keeper.is_active()
        if acting != self._acting:
            self._acting = acting
            if acting:
                log.info("%s acting (term %d)", self.role, self.term)
            else:
                log.warning("%s not acting: its lease window ran out (renewals not read back)", self.role)
        return acting

    def broker_restarted(self) -> None:
        """Call from the service's broker-restart callback: lease terms start again on the new
        broker (`LeaseKeeper.broker_restarted`)."""
        self.keeper.broker_restarted()

    async def start(self, activate: Callable[[int], Awaitable[None]]) -> None:
        """Join the election; `activate(term)` runs once this instance holds the lease."""
        await self.keeper.start()
        log.info("%s standing by as %s", self.role, self.keeper.holder)
        self._activation = asyncio.create_task(self._activate_when_elected(activate))

    async def _activate_when_elected(self, activate: Callable[[int], Awaitable[None]]) -> None:
        term = await self.keeper.wait_active()
        try:
            await activate(term)
        except Exception:  # a half-started active must not hold the lease: let the standby take it
            log.exception("%s: activation failed; exiting so the standby takes over", self.role)
            _exit_now(1)  # a failure, not a deposition: a supervisor must not restart it in a loop
        log.warning("%s active (term %d)", self.role, term)

    async def stop(self) -> None:
        """Stop; an active that stops cleanly releases its lease (its standby claims at once).
        Call it after the service's last write, so the successor reads everything."""
        if self._activation is not None:
            self._activation.cancel()
            await asyncio.gather(self._activation, return_exceptions=True)
        await self.keeper.stop(release=True)
