"""Live workers as the gateway sees them (from heartbeats): which models are served, by whom."""

from __future__ import annotations

import time

from shared.schemas.telemetry import Heartbeat


class WorkerDirectory:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._seen: dict[str, tuple[float, Heartbeat]] = {}

    def on_heartbeat(self, hb: Heartbeat) -> None:
        self._seen[hb.worker_id] = (time.monotonic(), hb)

    def live(self) -> list[Heartbeat]:
        cutoff = time.monotonic() - self.timeout_s
        return [hb for t, hb in self._seen.values() if t >= cutoff and not hb.draining]

    def models(self) -> dict[str, Heartbeat]:
        """Model id -> one live worker's heartbeat (for its context length)."""
        return {hb.model: hb for hb in self.live()}
