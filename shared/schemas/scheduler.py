"""`scheduler.state`: the scheduler's assignments, compacted by request id.

Written before a request is dispatched and tombstoned (null value) when it ends, so a restarted
scheduler reads this topic to the end and knows every request still in flight.
"""

from __future__ import annotations

from shared.schemas.base import WireModel


class Assignment(WireModel):
    request_id: str
    attempt: int
    worker_id: str
    gateway_id: str
    reply_partition: int
    req_class: str
    assigned_at: float
    # The lease term of the scheduler that wrote it: a record of a lower term read after one of a
    # higher term comes from a deposed scheduler and is dropped on replay (assignments.py).
    term: int = 0
