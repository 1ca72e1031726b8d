"""`be.capacity`: how much best-effort work the live workers can absorb right now.

The scheduler publishes this periodically from its live workers' loads and its assignment table;
the queue service keeps at most `slots` batch items in flight, so BE only fills the room RT
traffic leaves (a worker with RT waiting, or near its RT or KV limits, contributes nothing).
"""

from __future__ import annotations

from pydantic import Field

from shared.schemas.base import WireModel


class BECapacity(WireModel):
    source: str  # scheduler id
    sent_at: float  # wall clock (time.time())
    slots: int  # BE requests the live workers with RT headroom can hold at once
    in_flight: int = 0  # BE requests assigned to workers now (all sources)
    pending: int = 0  # BE requests the scheduler holds, waiting for room
    by_model: dict[str, int] = Field(default_factory=dict)  # slots per served model
