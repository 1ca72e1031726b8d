"""The scheduler's one settings object (`TANDEM_*` env vars)."""

from __future__ import annotations

from shared.settings import ServiceSettings


class SchedulerSettings(ServiceSettings):
    scheduler_id: str = "scheduler"
    placement: str = "least-loaded"
    session_routing: str = "advisory"  # where session turns go: advisory | sticky | none (affinity.py)
    holder_room: float = 0.75  # a session's holder takes its turn below this share of its RT slots
    be_per_worker: int = 32  # BE requests in flight per worker, at most
    kv_high_water: float = 0.9  # workers above this KV use take no BE
    max_pending: int = 10_000  # requests held (no capacity yet) before BE topics are paused
    unknown_request_grace_s: float = 3.0  # an assignment neither running nor finished this long after dispatch is lost
