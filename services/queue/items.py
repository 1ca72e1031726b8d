"""One batch item on the wire: its `GenerateRequest`, and its result assembled from result events
into the output line, with a response body shaped exactly like the synchronous endpoint's."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.openai_api.models import ENDPOINTS
from shared.openai_api.responses import shaper_for, usage
from shared.openai_api.translate import ReplyTo, to_generate_request
from shared.schemas.requests import GenerateRequest
from shared.schemas.results import Accepted, Delta, Failed


def item_request_id(batch_id: str, line: int) -> str:
    return f"{batch_id}-{line}"


def item_request(
    endpoint: str,
    body: dict,
    *,
    request_id: str,
    attempt: int,
    reply_to: ReplyTo,
    batch_id: str,
    custom_id: str,
    cache_salt: str | None = None,
) -> GenerateRequest:
    """A batch item as a class-BE request: the synchronous endpoint's translation
    (`shared.openai_api.translate`), with the batch id and custom_id in its metadata, salted
    with the batch owner's key (its prefix cache is the owner's, as for its synchronous calls)."""
    return to_generate_request(
        ENDPOINTS[endpoint].model_validate(body),
        request_id=request_id,
        attempt=attempt,
        reply_to=reply_to,
        req_class="be",
        metadata={"batch_id": batch_id, "custom_id": custom_id},
        cache_salt=cache_salt,
    )


@dataclass
class ItemRun:
    """An item in flight: the events of its current attempt, applied once and in order."""

    batch_id: str
    custom_id: str
    request: GenerateRequest
    service_tier: str | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    failure: Failed | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.failure is not None

    def restart(self, request: GenerateRequest) -> None:
        """A new attempt runs from scratch: forget the old one's partial output."""
        self.request = request
        self.token_ids, self.text, self.logprobs, self.token_texts = [], "", [], []
        self.prompt_tokens = self.cached_tokens = self.finish_reason = None

    def apply(self, event: Accepted | Delta | Failed) -> None:
        if isinstance(event, Accepted):
            self.prompt_tokens = self.prompt_tokens if self.prompt_tokens is not None else event.prompt_tokens
        elif isinstance(event, Failed):
            self.failure = event
        elif event.index == len(self.token_ids):  # anything else is a duplicate or out of order
            self._apply_delta(event)

    def _apply_delta(self, d: Delta) -> None:
        self.token_ids.extend(d.token_ids)
        self.text += d.text
        self.logprobs.extend(d.logprobs or [])
        self.token_texts.extend(d.token_texts or [])
        if d.cached_tokens is not None:
            self.cached_tokens = d.cached_tokens
        if d.prompt_tokens is not None and self.prompt_tokens is None:
            self.prompt_tokens = d.prompt_tokens
        self.finish_reason = d.finish_reason

    def output_line(self) -> dict:
        rid = self.request.request_id
        if self.failure is not None:
            err = {
                "error": {
                    "message": self.failure.message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": self.failure.code,
                }
            }
            response = {"status_code": self.failure.status, "request_id": rid, "body": err}
        else:
            response = {"status_code": 200, "request_id": rid, "body": self._body()}
        return {"id": f"batch_req_{rid}", "custom_id": self.custom_id, "response": response, "error": None}

    def _body(self) -> dict:
        req = self.request
        shaper = shaper_for(req.kind, req.request_id, int(time.time()), req.model, self.service_tier)
        u = usage(self.prompt_tokens or 0, len(self.token_ids), self.cached_tokens)
        lp = self.logprobs if req.sampling.logprobs else None
        return shaper.final(self.text, self.finish_reason or "stop", lp, self.token_texts, u)

    @property
    def succeeded(self) -> bool:
        return self.failure is None


def unfinished_line(request_id: str, custom_id: str, code: str, message: str) -> dict:
    """The error-file line of an item that never ran to the end (batch cancelled or expired)."""
    return {
        "id": f"batch_req_{request_id}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
