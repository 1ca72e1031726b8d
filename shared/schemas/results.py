"""`results`: what flows back to the process that owns a request (a gateway, or the queue service
for batch items), on the partition the request names.

Workers batch events: one `ResultBatch` carries every event for one results partition produced
in the same event-loop turn (one engine step), not one message per token per request. Events carry
(request_id, attempt) so a gateway can drop stale events from a worker that was declared lost,
and `Delta.index` (output tokens before this delta, counting resumed ones) so a delta is applied
exactly once and in order.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.schemas.base import WireModel


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    request_id: str
    attempt: int = 0


class Accepted(_Event):
    """The worker validated and queued the request."""

    type: Literal["accepted"] = "accepted"
    worker_id: str
    prompt_tokens: int  # the prompt the client sent (resumed tokens not included)


class Delta(_Event):
    type: Literal["delta"] = "delta"
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    token_texts: list[str] | None = None  # each token's text, sent when logprobs were asked for
    finish_reason: str | None = None  # set on the last delta: stop | length | abort
    # set on the last delta: what the worker measured
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


class Failed(_Event):
    """The request cannot be served (e.g. the prompt exceeds the context)."""

    type: Literal["failed"] = "failed"
    status: int = 400  # the HTTP status the synchronous endpoint answers with
    code: str = "invalid_request"
    message: str
    retry_after_s: float | None = None  # a 429's Retry-After (e.g. no worker can meet the SLO now)


class Rerouted(_Event):
    """The scheduler lost the worker running this request: the gateway resumes it with the tokens
    its client has; the queue service re-runs a batch item from scratch."""

    type: Literal["rerouted"] = "rerouted"
    reason: str


ResultEvent = Annotated[Accepted | Delta | Failed | Rerouted, Field(discriminator="type")]


class ResultBatch(WireModel):
    source: str  # worker or scheduler id
    events: list[ResultEvent]
