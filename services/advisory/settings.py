"""The advisory service's one settings object (`TANDEM_*` env vars)."""

from __future__ import annotations

from shared.settings import ServiceSettings


class AdvisorySettings(ServiceSettings):
    advisory_id: str = "advisory"
    target_policy: str = "least-loaded"  # how a hint's target worker is chosen (services/advisory/targets.py)
    # A placement (and the target's prefetch pin) lasts this long past the hint's expected arrival
    # (the hint's time when it names none); then it is tombstoned and the worker drops its pin.
    placement_ttl_s: float = 30.0
    max_placement_ttl_s: float = 300.0  # cap for hints announcing a far-off arrival
    # a hint naming no arrival is taken to come this long after it; once the turn has come, its
    # placement lasts only the grace (services/advisory/advisor.py, "How long a placement lives")
    default_arrival_s: float = 60.0
    turn_grace_s: float = 2.0
    hint_max_age_s: float = 30.0  # older hints (e.g. re-read after a restart) are dropped
    kv_high_water: float = 0.95  # workers above this KV use are not chosen while another is below
