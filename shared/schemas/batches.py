"""`batches`: the gateway tells the queue service that a batch changed in the database.

The batch API writes rows (docs/batch.md: the two share the database); this notice only says
"look now", so the queue service's work loop runs at once instead of polling the database on a
timer. It carries no state: a lost notice delays the batch until the queue's safety poll
(`TANDEM_IDLE_TICK_S`), never loses it.
"""

from __future__ import annotations

from typing import Literal

from shared.schemas.base import WireModel


class BatchNotice(WireModel):
    batch_id: str
    change: Literal["created", "cancelling"]
