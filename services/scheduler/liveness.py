"""The scheduler's view of which workers are alive: heartbeat intake and the housekeeping pass
(declare the silent lost, re-route the unaccounted, refresh the grant and the gauges).

Why it is shaped so (issue 22, eleventh session; docs/reliability.md, "Starvation is not
silence"):
- **Intake never waits on the broker.** A heartbeat is applied to the registry as it is read;
  what it leads to that needs a send (a fence re-sent to a stale epoch, finished requests'
  tombstones, the grant) runs in a follow-up task, coalesced per worker. It used to run inline,
  one acknowledged send after another per heartbeat, so on a loaded broker the reader fell
  seconds behind the heartbeats it was judging.
- **Silence is judged up to what was provably heard** (`Hearing`, shared/hearing.py), not up to now.
- **No step stalls the pass silently.** Each step runs under a timeout that names it when it
  fires; a failing step is logged and the next pass runs. A restarted scheduler once logged
  nothing for 79 s in a busy chaos run (session 10): a housekeeping step waiting on the broker
  (`consumer_lag` awaited `consumer.position`, which waits while a position is invalid) was
  one candidate that nothing could show. A pass slower than two heartbeat intervals says which
  step took the time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from services.scheduler.registry import Admission
from shared.aio import run_on_event, within
from shared.consumer_lag import consumer_lag
from shared.hearing import Hearing
from shared.kafka import fetch_decoded
from shared.schemas.telemetry import Heartbeat

if TYPE_CHECKING:
    from services.scheduler.service import SchedulerService

log = logging.getLogger(__name__)

# The longest one housekeeping step may take before it is given up for this pass (logged by
# name). A step's sends are each re-sent for up to ~5 s after a broker restart (RESEND), and a
# lost worker may hold several requests; a step cut short loses nothing: what it did not re-route
# stays assigned for the next pass, and a fence not sent is sent on the next stale heartbeat.
STEP_LIMIT_S = 15.0


class Liveness:
    def __init__(self, svc: SchedulerService) -> None:
        self.svc = svc
        self.hearing: Hearing | None = None  # made once the heartbeat reader exists (activation)
        self._stale: set[str] = set()  # workers whose fenced epoch was heard again: fence re-sent
        self._heard: set[str] = set()  # workers heard since the last follow-up: retire their finished
        self._follow_up = asyncio.Event()

    def start(self, consumer) -> None:
        s = self.svc.settings
        self.hearing = Hearing(consumer, probe_timeout_s=max(s.heartbeat_interval_s, 1.0), what="heartbeat")

    # -- intake ------------------------------------------------------------------------------

    async def heartbeat_loop(self) -> None:
        while True:
            for hb in await fetch_decoded(self.svc._hb, Heartbeat):  # noqa: SLF001 (the service's reader)
                self.on_heartbeat(hb)

    def on_heartbeat(self, hb: Heartbeat) -> None:
        svc = self.svc
        admission = svc.registry.on_heartbeat(hb)
        if admission is Admission.STALE:  # a lost epoch is alive: tell it again to rejoin
            self._stale.add(hb.worker_id)
        else:
            if admission is Admission.NEW:
                svc.kafka.remember(svc.topics.dispatch(hb.worker_id))  # repaired by us too after a broker restart
                log.info("worker %s joined (model %s, epoch %d)", hb.worker_id, hb.model, hb.epoch)
            svc.m.worker_up.labels(hb.worker_id).set(0 if hb.draining else 1)
            self._heard.add(hb.worker_id)
        self._follow_up.set()

    async def follow_up_loop(self) -> None:
        """What heartbeats lead to that needs the broker, off the reader's path."""
        failed = "heartbeat follow-up failed; the next heartbeat tries again"
        await run_on_event(self._follow_up, self._follow_up_round, failed=failed, logger=log)

    async def _follow_up_round(self) -> None:
        try:
            await self._follow_up_once()
        finally:  # a worker heard again may take pending requests, whatever the follow-up did
            self.svc._wake.set()  # noqa: SLF001

    async def _follow_up_once(self) -> None:
        svc = self.svc
        stale, self._stale = self._stale, set()
        heard, self._heard = self._heard, set()
        for wid in stale:
            await svc.failures.fence(wid, resend=True)
        if heard:
            await svc._grant()  # noqa: SLF001
        for wid in heard:
            try:
                await svc.failures.retire_finished(svc.registry.workers.get(wid))
            except Exception:  # noqa: BLE001 (the broker is briefly away: the next heartbeat retires them)
                log.warning("finished requests not retired", exc_info=True)

    # -- housekeeping ------------------------------------------------------------------------

    async def housekeeping_loop(self) -> None:
        svc = self.svc
        while True:
            await asyncio.sleep(svc.settings.heartbeat_interval_s)
            if not svc.lease.is_active():
                continue  # paused past its lease: the silence it would judge is its own (standby.py logs it)
            began, timings = time.monotonic(), {}
            await self._step("expire", self._expire(), timings)
            await self._step("grant", svc._grant(), timings)  # noqa: SLF001 (a lost worker leaves the grant now)
            await self._step("reroute_unaccounted", svc.failures.reroute_unaccounted(svc.started), timings)
            await self._step("probe", self.hearing.probe(), timings)
            svc.m.workers.set(len(svc.registry.workers))
            for topic, lag in consumer_lag(svc._req).items():  # noqa: SLF001 (no request: held positions)
                svc.m.lag.labels(topic).set(lag)
            svc.m.housekeeping.inc()
            took = time.monotonic() - began
            if took > 2 * svc.settings.heartbeat_interval_s:  # a deaf probe alone takes about one
                slowest = max(timings, key=timings.get)
                log.warning("housekeeping pass took %.1f s (slowest step: %s, %.1f s)", took, slowest, timings[slowest])
            svc._wake.set()  # noqa: SLF001

    async def _expire(self) -> None:
        svc = self.svc
        heard_until = self.hearing.caught_up()
        for wid in svc.registry.expire(heard_until):
            svc.m.worker_up.remove(wid)
            await svc.failures.worker_lost(wid)

    async def _step(self, name: str, step: Awaitable[None], timings: dict[str, float]) -> None:
        """Run one step, bounded; a step that fails or overruns is logged by name, never silent."""
        began = time.monotonic()
        try:
            await within(step, STEP_LIMIT_S)
        except TimeoutError:
            log.warning("housekeeping step %s did not finish within %.0f s: given up for this pass", name, STEP_LIMIT_S)
        except Exception:  # noqa: BLE001 (one failing step must not end housekeeping for good)
            log.warning("housekeeping step %s failed", name, exc_info=True)
        timings[name] = time.monotonic() - began

    def broker_restarted(self) -> None:
        """Every worker gets a fresh window: its heartbeats were refused while the broker was
        away or repaired, which is not the worker's silence (every broker restart of session
        10's chaos runs declared one or both workers lost and re-ran their requests)."""
        self.svc.registry.hear_all_now()
        if self.hearing is not None:
            self.hearing.restart()
