"""`placement.grants`: the RT slots the active scheduler lends the gateways (two-hop RT dispatch).

The scheduler stays the authority for placement by publishing it: a grant names, for each live
worker it would place RT requests on now, its epoch, its model and how many RT requests each
gateway may send it directly at once (`slots`). A gateway with a live grant sends an RT request
straight to the worker's dispatch topic, stamped with the grant's term and the worker's epoch,
and a copy flagged `granted_worker` to `requests.rt`, which the scheduler records as its own
placement (docs/services.md, "RT dispatch by grant").

A grant is good for `ttl_s` after it was read (the gateway's own clock, so the two hosts' clocks
need not agree), until a grant of a higher (term, sequence) replaces it, or until the scheduler
revokes it (a grant with no workers: on a clean stop). A worker the gateway no longer sees as live
(heartbeats, fences) is skipped whatever the grant says.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from shared.schemas.base import WireModel


class WorkerGrant(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    worker_id: str
    epoch: int  # the worker's epoch when granted: a dispatch stamped with it is dropped once fenced
    model: str
    slots: int = Field(ge=0)  # RT requests in flight at once per gateway through this grant


class PlacementGrant(WireModel):
    scheduler_id: str
    term: int  # the scheduler's lease term: stamped on granted dispatches (`scheduler_term`)
    sequence: int  # grows with every grant of a term; a gateway keeps the highest (term, sequence)
    sent_at: float  # wall clock (time.time()), for logs and `tandem status`
    ttl_s: float  # how long after it is read the grant may be used
    workers: list[WorkerGrant] = Field(default_factory=list)  # empty: revoked
