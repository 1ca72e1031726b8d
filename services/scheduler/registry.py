"""Live workers, from heartbeats and telemetry."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from shared.schemas.telemetry import Heartbeat, Telemetry

log = logging.getLogger(__name__)
# Logged (once per process) when a worker declared lost turns out to be alive: its silence was
# longer than the timeout (a starved machine, a long pause), so the timeout is too short for the
# deployment. The test stacks fail on it (tests/services/conftest.py).
LOST_BUT_ALIVE = "was declared lost but is still heartbeating"


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
        # Ids declared lost -> the start time of that process: its late heartbeats are ignored, but a
        # new process with the same id (a restart, which keeps the worker's session directory) is not.
        self._lost: dict[str, float] = {}
        self._heard_after_loss: set[str] = set()  # lost ids whose process was heard again (warned once)

    def on_heartbeat(self, hb: Heartbeat) -> bool:
        """Record a heartbeat; True when the worker is new."""
        lost_started_at = self._lost.get(hb.worker_id)
        if lost_started_at is not None:
            if hb.started_at <= lost_started_at:
                self._warn_alive_after_loss(hb.worker_id)
                return False
            del self._lost[hb.worker_id]
            self._heard_after_loss.discard(hb.worker_id)
        info = self.workers.get(hb.worker_id)
        now = time.monotonic()
        if info is None:
            info = self.workers[hb.worker_id] = WorkerInfo(hb, now)
            new = True
        else:
            info.heartbeat, info.last_seen, new = hb, now, False
        info.running, info.finished = set(hb.running_ids), set(hb.finished_ids)
        return new

    def _warn_alive_after_loss(self, worker_id: str) -> None:
        if worker_id not in self._heard_after_loss:
            self._heard_after_loss.add(worker_id)
            log.warning(
                "worker %s %s: it was silent for more than %.1f s (worker_timeout_s); "
                "its requests were re-placed and it gets no new work until it restarts",
                worker_id,
                LOST_BUT_ALIVE,
                self.timeout_s,
            )

    def on_telemetry(self, t: Telemetry) -> None:
        info = self.workers.get(t.worker_id)
        if info is not None:
            info.telemetry = t

    def expire(self) -> list[str]:
        """Drop workers silent for longer than the timeout; return their ids."""
        cutoff = time.monotonic() - self.timeout_s
        gone = [wid for wid, w in self.workers.items() if w.last_seen < cutoff]
        for wid in gone:
            self._lost[wid] = self.workers.pop(wid).heartbeat.started_at
        return gone

    def live(self) -> list[WorkerInfo]:
        return list(self.workers.values())
