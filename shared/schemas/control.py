"""`control`: commands every worker and the scheduler read (`Prefetch` is in `sessions.py`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from shared.schemas.base import WireModel
from shared.schemas.sessions import Prefetch


class Cancel(WireModel):
    """The client went away: stop generating and free the KV."""

    type: Literal["cancel"] = "cancel"
    request_id: str


class Drain(WireModel):
    """Stop accepting new work on a worker (the scheduler stops placing there); finish what runs."""

    type: Literal["drain"] = "drain"
    worker_id: str


class Fence(WireModel):
    """The scheduler declared `worker_id` lost at `epoch` and re-placed its requests: that epoch's
    work is stale. The worker drops it and rejoins with a higher epoch; until then its heartbeats
    of a fenced epoch count for nothing (not placed on, not live in `/health`)."""

    type: Literal["fence"] = "fence"
    worker_id: str
    epoch: int


ControlMessage = Annotated[Cancel | Drain | Prefetch | Fence, Field(discriminator="type")]


class ControlEnvelope(WireModel):
    message: ControlMessage
