"""Live workers as the advisory service sees them: heartbeats (alive, model, KV URL) and telemetry (load)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from shared.schemas.telemetry import Heartbeat, Telemetry


@dataclass
class WorkerState:
    heartbeat: Heartbeat
    last_seen: float  # monotonic
    telemetry: Telemetry | None = None


class WorkerView:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._workers: dict[str, WorkerState] = {}

    def on_heartbeat(self, hb: Heartbeat) -> None:
        state = self._workers.get(hb.worker_id)
        if state is None:
            self._workers[hb.worker_id] = WorkerState(hb, time.monotonic())
        else:
            state.heartbeat, state.last_seen = hb, time.monotonic()

    def on_telemetry(self, t: Telemetry) -> None:
        state = self._workers.get(t.worker_id)
        if state is not None:
            state.telemetry = t

    def live(self) -> dict[str, WorkerState]:
        """Workers heard from within the timeout and not draining."""
        cutoff = time.monotonic() - self.timeout_s
        return {wid: s for wid, s in self._workers.items() if s.last_seen >= cutoff and not s.heartbeat.draining}
