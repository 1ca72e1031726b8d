"""An OpenAI request body becomes a `GenerateRequest`: the one translation every service uses.

The gateway calls it for a synchronous request and the queue service for a batch item, so the
two cannot drift apart: the same sampling options, token limit, logprobs choice and prompt
reach the worker either way. What differs between them is passed in, never guessed here: the
request id, the class, the SLOs (the gateway adds its class defaults for RT; a batch item
carries only its body's `tandem` targets), the session (the gateway reads `X-Session-Id` or
`tandem.session_id`; batch items run without one), and where results go.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shared.openai_api.models import OpenAIRequest
from shared.schemas.requests import GenerateRequest, RequestClassName, SLOTargets


@dataclass(frozen=True)
class ReplyTo:
    """Where a request's results go: the reader's id and the results partition it reads."""

    reader_id: str  # a gateway's id, or the queue service's
    partition: int


def to_generate_request(
    body: OpenAIRequest,
    *,
    request_id: str,
    reply_to: ReplyTo,
    req_class: RequestClassName,
    slo: SLOTargets | None = None,
    session_id: str | None = None,
    attempt: int = 0,
    metadata: dict[str, str] | None = None,
    cache_salt: str | None = None,
) -> GenerateRequest:
    """The wire request for `body`; `slo` None means the body's own `tandem` targets;
    `cache_salt`: the caller's key's prefix-cache salt (server-side, never from the body).

    Raises pydantic's `ValidationError` when the result is not a valid request.
    """
    return GenerateRequest(
        request_id=request_id,
        attempt=attempt,
        gateway_id=reply_to.reader_id,
        reply_partition=reply_to.partition,
        model=body.model,
        kind=body.kind,
        messages=body.messages if body.kind == "chat" else None,
        prompt=body.prompt if body.kind == "completion" else None,
        sampling=body.sampling(),
        req_class=req_class,
        slo=body.slo() if slo is None else slo,
        session_id=session_id,
        created_at=time.time(),
        metadata=metadata or {},
        cache_salt=cache_salt,
    )
