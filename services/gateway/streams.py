"""The gateway's in-flight requests and the routing of result events to them.

Each request has a `RequestStream`: the tokens and text its client has been given so far, and
an asyncio queue of events for the HTTP handler. Events are applied at most once and in order:
stale attempts are dropped, deltas are placed by `index`. On `Rerouted` the stream re-submits
its request with the tokens already delivered (`GenerateRequest.resumed`), so the client's
stream continues on another worker with nothing lost or repeated.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from shared.schemas.requests import GenerateRequest
from shared.schemas.results import Accepted, Delta, Failed, Rerouted, ResultBatch

log = logging.getLogger(__name__)


@dataclass
class RequestStream:
    request: GenerateRequest  # the latest attempt
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Accepted | Delta | Failed
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None
    worker_id: str | None = None
    finished: bool = False
    trace: Span | None = None  # the request's root span (shared/tracing.py)
    first_batch_ns: tuple[int | None, int] | None = None  # (sent, read) of the batch with the first token

    @property
    def attempt(self) -> int:
        return self.request.attempt


Resubmit = Callable[[GenerateRequest], Awaitable[None]]


class StreamRegistry:
    def __init__(self, resubmit: Resubmit, on_close: Callable[[str], None] = lambda request_id: None) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._resubmit = resubmit
        self._on_close = on_close  # the request's grant slot, if it had one, is free again
        self.resumed = 0  # requests re-placed after a worker loss

    def open(self, request: GenerateRequest) -> RequestStream:
        stream = self._streams[request.request_id] = RequestStream(request)
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._on_close(request_id)

    def __len__(self) -> int:
        return len(self._streams)

    def get(self, request_id: str) -> RequestStream | None:
        return self._streams.get(request_id)

    def fail_open(self, failure: Callable[[RequestStream], Failed]) -> list[str]:
        """End every open stream with the `Failed` event `failure` makes for it (the broker
        restarted: their results will never come); returns their request ids."""
        ended = []
        for rid, stream in self._streams.items():
            if not stream.finished:
                stream.finished = True
                stream.events.put_nowait(failure(stream))
                ended.append(rid)
        return ended

    async def on_batch(self, batch: ResultBatch, sent_ns: int | None = None, read_ns: int = 0) -> None:
        """Route `batch`'s events; `sent_ns`/`read_ns` (its send and read times) time the first
        token's Kafka hop."""
        for event in batch.events:
            stream = self._streams.get(event.request_id)
            if stream is None or stream.finished or event.attempt != stream.attempt:
                continue  # not ours (shared partition), already done, or a stale attempt
            if isinstance(event, Rerouted):
                await self._resume(stream, event.reason)
            elif isinstance(event, Delta):
                if stream.first_batch_ns is None and not stream.token_ids and event.token_ids:
                    stream.first_batch_ns = (sent_ns, read_ns)
                if not self._apply_delta(stream, event):
                    await self._resume(stream, f"delta gap: have {len(stream.token_ids)}, got {event.index}")
            else:
                self._apply_other(stream, event)

    def _apply_other(self, stream: RequestStream, event: Accepted | Failed) -> None:
        if isinstance(event, Accepted):
            stream.worker_id = event.worker_id
            if stream.prompt_tokens is None:
                stream.prompt_tokens = event.prompt_tokens
        else:
            stream.finished = True
        stream.events.put_nowait(event)

    def _apply_delta(self, stream: RequestStream, d: Delta) -> bool:
        """Apply `d` in order; False when it skips ahead (the deltas between were lost)."""
        have = len(stream.token_ids)
        if d.index + len(d.token_ids) <= have and d.finish_reason is None:
            return True  # a duplicate
        if d.index != have:
            return False
        stream.token_ids.extend(d.token_ids)
        stream.text += d.text
        if d.finish_reason is not None:
            stream.finished = True
        stream.events.put_nowait(d)
        return True

    async def _resume(self, stream: RequestStream, reason: str) -> None:
        """Submit the next attempt, continuing from the tokens the client has (after a worker
        loss, or a gap: result records lost on their way, as a broker restart can do; the
        attempt that lost them is stale from now on, so the rest of its deltas are dropped)."""
        stream.request = stream.request.resumed(stream.token_ids)
        self.resumed += 1
        log.warning(
            "resuming after %d tokens: %s",
            len(stream.token_ids),
            reason,
            extra={"request_id": stream.request.request_id},
        )
        await self._resubmit(stream.request)
