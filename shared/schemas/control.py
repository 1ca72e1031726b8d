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


ControlMessage = Annotated[Cancel | Drain | Prefetch, Field(discriminator="type")]


class ControlEnvelope(WireModel):
    message: ControlMessage
