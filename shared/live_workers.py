"""Live workers as a service sees them from the `heartbeats` and `telemetry` topics.

The gateway (models, health, session stats), the queue service (which models a batch may name)
and the advisory service (load of each candidate target) all keep this view. The scheduler
keeps its own `WorkerRegistry` on purpose: it also tracks what each worker runs and finished,
and declares workers lost (its fences reach this view through `on_fence`).

A worker is live when heard from within `timeout_s`, not draining, and not at an epoch the
scheduler fenced (`on_fence`: a worker declared lost that resumed; fed from the `control` topic by
the gateway, and from the scheduler's remembered fences, `scheduler.fences`, by the queue and
advisory services through `shared/fence_feed.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shared.schemas.telemetry import Heartbeat, Telemetry


@dataclass
class WorkerState:
    heartbeat: Heartbeat
    last_seen: float  # monotonic
    telemetry: Telemetry | None = None  # None until its first report (or when nobody feeds telemetry)


class LiveWorkers:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._workers: dict[str, WorkerState] = {}
        self._fenced: dict[str, int] = {}  # worker id -> highest epoch the scheduler declared lost

    def on_heartbeat(self, hb: Heartbeat) -> None:
        state = self._workers.get(hb.worker_id)
        if state is None:
            self._workers[hb.worker_id] = WorkerState(hb, time.monotonic())
        else:
            state.heartbeat, state.last_seen = hb, time.monotonic()

    def on_fence(self, worker_id: str, epoch: int) -> None:
        self._fenced[worker_id] = max(epoch, self._fenced.get(worker_id, epoch))

    def on_telemetry(self, t: Telemetry) -> None:
        state = self._workers.get(t.worker_id)
        if state is not None:
            state.telemetry = t

    def live(self) -> dict[str, WorkerState]:
        """Worker id -> state, for the live workers."""
        cutoff = time.monotonic() - self.timeout_s
        return {
            wid: s
            for wid, s in self._workers.items()
            if s.last_seen >= cutoff and not s.heartbeat.draining and s.heartbeat.epoch > self._fenced.get(wid, -1)
        }

    def heartbeats(self) -> list[Heartbeat]:
        """The live workers' latest heartbeats."""
        return [s.heartbeat for s in self.live().values()]

    def models(self) -> dict[str, Heartbeat]:
        """Model id -> one live worker's heartbeat (for its context length)."""
        return {hb.model: hb for hb in self.heartbeats()}
