"""Live workers, from heartbeats and telemetry, and which of their epochs are fenced.

A worker process carries an epoch (`Heartbeat.epoch`): its start time in milliseconds, raised
past a fence when it is re-admitted. A worker silent for longer than the timeout is declared
lost *at its epoch*: its requests are re-placed, and every later heartbeat of that epoch is
stale. A stale heartbeat is not ignored for good (the process is alive after all: a long pause,
a starved machine): the scheduler answers it with a `Fence`, the worker drops that epoch's work
and comes back with a higher epoch, and that heartbeat re-admits it like a new worker.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

from shared.schemas.telemetry import Heartbeat, Telemetry

log = logging.getLogger(__name__)
# Logged (once per lost epoch) when a worker declared lost turns out to be alive: its silence was
# longer than the timeout (a starved machine, a long pause), so the timeout is too short for the
# deployment unless the pause was deliberate. The test stacks fail on it (tests/services/conftest.py)
# except for workers a test paused on purpose.
LOST_BUT_ALIVE = "was declared lost but is still heartbeating"


class Admission(enum.Enum):
    NEW = "new"  # first heard (or heard again after its loss, at a higher epoch: re-admitted)
    KNOWN = "known"  # a live worker's next heartbeat
    STALE = "stale"  # a heartbeat of a fenced epoch: answer it with a fence, place nothing there


@dataclass
class WorkerInfo:
    heartbeat: Heartbeat
    last_seen: float  # monotonic
    telemetry: Telemetry | None = None
    running: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)


class WorkerRegistry:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.workers: dict[str, WorkerInfo] = {}
        self.fenced: dict[str, int] = {}  # worker id -> its highest epoch declared lost
        self._heard_after_loss: set[tuple[str, int]] = set()  # (id, epoch) warned about once

    def on_heartbeat(self, hb: Heartbeat) -> Admission:
        """Record a heartbeat and say what it means for placement."""
        now = time.monotonic()
        info = self.workers.get(hb.worker_id)
        fenced = self.fenced.get(hb.worker_id)
        if fenced is not None:
            if hb.epoch <= fenced:
                self._warn_alive_after_loss(hb.worker_id, hb.epoch)
                return Admission.STALE
            del self.fenced[hb.worker_id]
            log.info("worker %s re-admitted at epoch %d (lost at %d)", hb.worker_id, hb.epoch, fenced)
        if info is None:
            info = self.workers[hb.worker_id] = WorkerInfo(hb, now)
            admission = Admission.NEW
        else:
            info.heartbeat, info.last_seen, admission = hb, now, Admission.KNOWN
        info.running, info.finished = set(hb.running_ids), set(hb.finished_ids)
        return admission

    def _warn_alive_after_loss(self, worker_id: str, epoch: int) -> None:
        if (worker_id, epoch) not in self._heard_after_loss:
            self._heard_after_loss.add((worker_id, epoch))
            log.warning(
                "worker %s %s: it was silent for more than %.1f s (worker_timeout_s); "
                "its requests were re-placed; fencing epoch %d so it drops them and rejoins",
                worker_id,
                LOST_BUT_ALIVE,
                self.timeout_s,
                epoch,
            )

    def on_telemetry(self, t: Telemetry) -> None:
        """Telemetry is a record the worker produced, so it counts as being heard too (a worker
        whose heartbeats are late behind its other records is not silent). Only a worker heard
        at a live epoch is in `workers`: a fenced one's telemetry re-admits nothing."""
        info = self.workers.get(t.worker_id)
        if info is not None:
            info.telemetry = t
            info.last_seen = time.monotonic()

    def expire(self, heard_until: float | None = None) -> list[str]:
        """Declare lost the workers silent for longer than the timeout as of `heard_until` (the
        time up to which the scheduler provably read every heartbeat, shared/hearing.py; default now),
        and return their ids."""
        cutoff = (time.monotonic() if heard_until is None else heard_until) - self.timeout_s
        gone = [wid for wid, w in self.workers.items() if w.last_seen < cutoff]
        for wid in gone:
            self._declare_lost(wid)
        return gone

    def hear_all_now(self) -> None:
        """A fresh window for every worker: after a broker restart their heartbeats were refused
        or went to topics that no longer exist, a silence that was the broker's."""
        now = time.monotonic()
        for info in self.workers.values():
            info.last_seen = max(info.last_seen, now)

    def _declare_lost(self, worker_id: str) -> None:
        info = self.workers.pop(worker_id)
        self.fenced[worker_id] = max(info.heartbeat.epoch, self.fenced.get(worker_id, -1))

    def remember_fence(self, worker_id: str, epoch: int) -> None:
        """A fence published before this scheduler started (read back from `scheduler.fences`)."""
        self.fenced[worker_id] = max(epoch, self.fenced.get(worker_id, -1))

    def live(self) -> list[WorkerInfo]:
        return list(self.workers.values())
