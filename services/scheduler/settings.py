"""The scheduler's one settings object (`TANDEM_*` env vars)."""

from __future__ import annotations

from typing import Literal

from shared.settings import ServiceSettings


class SchedulerSettings(ServiceSettings):
    scheduler_id: str = "scheduler"
    placement: str = "least-loaded"  # least-loaded | slo (placement.py, slo_placement.py)
    # slo placement (docs/services.md, "Placement by SLO"): targets for requests that name none,
    # what to do with an RT request no worker is predicted to serve in time (admit it on the best
    # worker with the reason logged and counted, or answer 429 with Retry-After), the KV link
    # between workers (None: a moved session is priced as a recompute), and the prompt estimate
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.2
    slo_overload: Literal["admit", "reject"] = "admit"
    kv_transfer_bytes_per_s: float | None = None
    chars_per_token: float = 4.0
    session_routing: str = "advisory"  # where session turns go: advisory | sticky | none (affinity.py)
    holder_room: float = 0.75  # a session's holder takes its turn below this share of its RT slots
    holder_slack: float = 4.0  # ... and within this many requests' load of the least-loaded worker
    # A dispatch its worker's heartbeats say it has not read yet is not lost before this much
    # time (failures.py, `reroute_unaccounted`: a worker slow to read under load is not re-routed
    # at `unknown_request_grace_s`, which ran the request twice; a reader stuck for good is).
    unread_dispatch_grace_s: float = 20.0
    be_per_worker: int = 32  # BE requests in flight per worker, at most
    kv_high_water: float = 0.9  # workers above this KV use take no BE
    max_pending: int = 10_000  # requests held (no capacity yet) before BE topics are paused
    unknown_request_grace_s: float = 3.0  # an assignment neither running nor finished this long after dispatch is lost
    # RT dispatch by grant (services/scheduler/grants.py; the gateway's `rt_grants` reads the same
    # TANDEM_RT_GRANTS): publish RT slots the gateways may fill directly (two hops to the first
    # token instead of three); `grant_slots` RT requests in flight per gateway and worker; a grant
    # is good for `grant_ttl_s` after it is read (None: `worker_timeout_s`).
    rt_grants: bool = False
    grant_slots: int = 4
    grant_ttl_s: float | None = None
