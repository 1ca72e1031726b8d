"""The requests one worker runs: which dispatches it admits, one task per request through the
engine, its results to the outbox, and the running/finished lists its heartbeats carry.

Admission (`accept`) drops, in this order: a malformed record; a dispatch of a deposed
scheduler (a lease term below one already seen: its successor placed the request again); one
stamped with an epoch of ours the scheduler fenced (it re-placed that work); one whose gateway is
gone (nobody reads its results; reported finished so the scheduler forgets it); and a
re-delivered one (keyed "request_id:attempt", so a consumer restart applies it once and a resumed
attempt never collides with a stale one). A newer attempt of a request still running here
replaces the old one.

The engine is reached only through `AsyncLLM`; its thread owns the tokenizer, so prompts travel
to it as text or chats and are tokenized in the hop that queues them.

**Hop spans are recorded off the first token's path** (issue 21, ninth session). A span costs
the event loop ~50-120 us (the OpenTelemetry SDK, the hop histogram, the exporter's queue), and
the worker used to record `worker.consume` before queueing the request, `worker.engine_queue`
while the engine computed the first step (competing for the GIL with it) and
`worker.first_token` before handing the token to the outbox. Now the times are only stamped on
the path and every span of the request's hand-off is recorded once the request's last batch is
acknowledged (`_Trace.record`; the first batch's ack only stamps its time): recorded at the
first token's ack (the ninth session), the seven spans (~0.4-0.8 ms of the loop) fell in the
request's first inter-token gap, the suspect for that session's inter-token figure being ~0.8 ms
worse. They are recorded beside the stages of the hand-off the engine thread stamps
(`engine/engine_thread.py`): `worker.to_engine` (dispatch read → the engine thread took it:
the admission, the request's task, the thread hop), `worker.engine_add` (tokenize, validate,
queue), `worker.step_wait` (queued → its first step started: a step in progress),
`worker.first_step` (that step) and `worker.to_loop` (the step's end → its delta on the
event loop: the thread hop back). A request whose last batch is never acknowledged (an error,
a cancel) records no spans; one the engine refuses records `worker.consume` only.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from opentelemetry.context import Context

from engine.async_llm import AsyncLLM, RequestStream, StreamDelta
from services.worker.adapter import EngineRequest, to_engine_request
from services.worker.outbox import ResultOutbox
from services.worker.sessions import WorkerSessions
from services.worker.telemetry import TelemetryWindow, request_timing
from shared.records import decode_record
from shared.schemas.requests import GenerateRequest
from shared.schemas.results import Accepted, Delta, Failed
from shared.tracing import Tracing, context_of, sent_ns

log = logging.getLogger(__name__)

_SEEN_LIMIT = 100_000  # dispatch keys remembered for de-duplication
_FINISHED_WINDOW_S = 60.0  # how long a finished request is listed in heartbeats


@dataclass
class _Trace:
    """A dispatched request's trace context and the worker-side times of its hand-off (wall-clock
    ns), recorded as spans off the token's path (module docstring)."""

    context: Context | None
    read_ns: int  # the worker read the dispatch record
    sent_ns: int | None = None  # the scheduler sent it (from the record's headers)
    accepted_ns: int = 0  # the event loop had the engine's acceptance
    picked_ns: int = 0  # the engine thread took the request (engine thread's stamp)
    queued_ns: int = 0  # the engine had it queued (engine thread's stamp)
    first_acked_ns: int = 0  # the broker acknowledged the first token's batch

    def record_consume(self, tracing: Tracing) -> None:
        if self.sent_ns is not None:
            tracing.hop("worker.consume", self.context, self.sent_ns, self.read_ns)

    def record(self, tracing: Tracing, first: StreamDelta, first_ns: int) -> None:
        """Every span of the hand-off, once the request's last token has left (module docstring)."""
        self.record_consume(tracing)
        ctx = self.context
        tracing.hop("worker.result_produce", ctx, first_ns, self.first_acked_ns or None)
        tracing.hop("worker.engine_queue", ctx, self.read_ns, self.accepted_ns)
        tracing.hop("worker.first_token", ctx, self.accepted_ns, first_ns)
        if not (self.picked_ns and first.step_started_ns and first.posted_ns):
            return  # an engine that did not stamp its hand-off
        tracing.hop("worker.to_engine", ctx, self.read_ns, self.picked_ns)
        tracing.hop("worker.engine_add", ctx, self.picked_ns, self.queued_ns)
        tracing.hop("worker.step_wait", ctx, self.queued_ns, first.step_started_ns)
        tracing.hop("worker.first_step", ctx, first.step_started_ns, first.posted_ns)
        tracing.hop("worker.to_loop", ctx, first.posted_ns, first_ns)


class RequestRunner:
    """`owner_is_dead(gateway_id)`: whether a request's gateway was declared gone (owners.py)."""

    def __init__(
        self,
        worker_id: str,
        llm: AsyncLLM,
        outbox: ResultOutbox,
        sessions: WorkerSessions,
        tracing: Tracing,
        telemetry: TelemetryWindow,
        owner_is_dead: Callable[[str], bool],
        accept_hold_s: float = 0.0,
    ) -> None:
        self.worker_id = worker_id
        self.llm, self.outbox, self.sessions = llm, outbox, sessions
        self.tracing, self.telemetry = tracing, telemetry
        self._owner_is_dead = owner_is_dead
        self.accept_hold_s = accept_hold_s  # how long an Accepted waits for the first delta
        self.fenced_epoch = -1  # the highest epoch of ours the scheduler declared lost
        self.scheduler_term = 0  # the highest scheduler lease term seen on a dispatch (older ones are dropped)
        self._tasks: dict[str, asyncio.Task] = {}  # request_id -> its stream task
        self._requests: dict[str, GenerateRequest] = {}  # request_id -> the attempt that task serves
        self._seen: OrderedDict[str, None] = OrderedDict()
        # The level a dispatch's receipt is logged at: INFO in the broker watch's recovery window
        # (the service sets it), DEBUG otherwise; a request lost after a restart then shows
        # whether the worker read it (it could not be told from the INFO logs of session 8).
        self.receipt_level: Callable[[], int] = lambda: logging.DEBUG
        self._finished: deque[tuple[float, str]] = deque()

    # -- what heartbeats say -----------------------------------------------------------------

    def running_keys(self) -> list[str]:
        return [t.get_name() for t in self._tasks.values()]

    def finished_keys(self) -> list[str]:
        """Requests finished (or dropped as finished) in the last minute."""
        now = time.monotonic()
        while self._finished and self._finished[0][0] < now - _FINISHED_WINDOW_S:
            self._finished.popleft()
        return [k for _, k in self._finished]

    # -- ending requests ---------------------------------------------------------------------

    def cancel(self, request_id: str) -> bool:
        """Leave the request's engine stream (aborts it, frees its KV); False if not running here."""
        task = self._tasks.get(request_id)
        if task is None:
            return False
        task.cancel()
        return True

    def cancel_all(self) -> int:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        return len(tasks)

    def of_owner(self, gateway_id: str) -> list[GenerateRequest]:
        return [r for r in self._requests.values() if r.gateway_id == gateway_id]

    async def drain(self, timeout_s: float) -> None:
        """Let running requests finish (bounded), then cancel what is left and wait for it."""
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=timeout_s)
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- admission ---------------------------------------------------------------------------

    def accept(self, record) -> None:
        """One dispatch record: admitted into its own task, or dropped (module docstring)."""
        read_ns = time.time_ns()
        req = decode_record(GenerateRequest, record)
        if req is None:
            return  # malformed: logged and skipped
        hop = _Trace(context_of(record.headers), read_ns, sent_ns(record.headers))  # spans: module doc
        key = f"{req.request_id}:{req.attempt}"
        log.log(
            self.receipt_level(),
            "dispatch received (%s[%d]@%d)",
            record.topic,
            record.partition,
            record.offset,
            extra={"request_id": req.request_id},
        )
        if req.scheduler_term is not None:  # a deposed scheduler's late dispatch: its successor placed it
            if req.scheduler_term < self.scheduler_term:
                log.info("dropped: dispatched at stale scheduler term %d", req.scheduler_term)
                return
            self.scheduler_term = req.scheduler_term
        if req.worker_epoch is not None and req.worker_epoch <= self.fenced_epoch:
            log.info("dropped: dispatched to fenced epoch %d", req.worker_epoch, extra={"request_id": req.request_id})
            return  # the scheduler re-placed it when it fenced that epoch
        if self._owner_is_dead(req.gateway_id):
            log.info("dropped: its gateway %s is gone", req.gateway_id, extra={"request_id": req.request_id})
            self._finished.append((time.monotonic(), key))  # done, as far as the scheduler is concerned
            # Told, as a cancelled request is (service.py, `_cancel_orphaned`): a gateway that was
            # only misjudged answers its client at once instead of after its 60 s timeout.
            message = f"gateway {req.gateway_id} was declared lost; the request was dropped"
            failed = Failed(
                request_id=req.request_id, attempt=req.attempt, status=503, code="owner_lost", message=message
            )
            self.outbox.put(req.reply_partition, failed)
            return
        if key in self._seen:
            return
        self._remember(key)
        old = self._tasks.get(req.request_id)
        if old is not None:
            old.cancel()  # an older attempt of the same request still here: the new one wins
        self._tasks[req.request_id] = asyncio.create_task(self._serve(req, hop), name=key)
        self._requests[req.request_id] = req

    def _remember(self, key: str) -> None:
        self._seen[key] = None
        while len(self._seen) > _SEEN_LIMIT:
            self._seen.popitem(last=False)

    # -- one request -------------------------------------------------------------------------

    async def _serve(self, req: GenerateRequest, hop: _Trace | None = None) -> None:
        hop = hop or _Trace(None, time.time_ns())
        try:
            try:
                er = to_engine_request(req, self.llm.info.max_model_len)
                if req.session_id is not None and self.sessions.must_prepare(req):
                    stream = await self._enter_after_prepare(req, er)
                else:
                    stream = await self._enter(er, req)
                    self._accepted(req, stream.num_prompt_tokens)
                hop.accepted_ns = time.time_ns()
                hop.picked_ns, hop.queued_ns = stream.picked_ns, stream.queued_ns
            except ValueError as exc:
                hop.record_consume(self.tracing)
                failed = Failed(request_id=req.request_id, attempt=req.attempt, message=str(exc))
                self.outbox.put(req.reply_partition, failed)
                return
            try:
                await self._stream(req, er, stream, hop)
            finally:
                stream.close()  # before the last delta (cancelled): aborts the request, frees its KV
        finally:
            self._forget(req)

    async def _enter(self, er: EngineRequest, req: GenerateRequest) -> RequestStream:
        """Into the engine: tokenized, validated and queued on the engine thread in one hop."""
        return await self.llm.add_request(
            er.key,
            er.prompt,
            er.params,
            req_class=er.req_class,
            slo=er.slo,
            resumed_output_ids=er.resumed_output_ids,
            session_id=req.session_id,
            cache_salt=req.cache_salt,
        )

    async def _enter_after_prepare(self, req: GenerateRequest, er: EngineRequest) -> RequestStream:
        """A session turn that must wait for (or decide on) a KV pull before it enters the engine:
        checked first, so a bad request fails before any transfer and the pull decision knows the
        prompt's length; accepted; prepared; then added. One more engine hop than `_enter`, on a
        turn that is about to pull KV or recompute its history anyway."""
        checked = await self.llm.check(er.prompt, er.params, er.resumed_output_ids)
        self._accepted(req, len(checked.prompt_token_ids))
        await self.sessions.prepare(req, len(checked.prompt_token_ids))
        return await self._enter(replace(er, prompt=checked.prompt_token_ids, params=checked.params), req)

    def _accepted(self, req: GenerateRequest, prompt_tokens: int) -> None:
        """Held until the first delta (outbox.py): one message, not two, on the first token's path."""
        self.outbox.put_held(
            req.reply_partition,
            Accepted(
                request_id=req.request_id,
                attempt=req.attempt,
                worker_id=self.worker_id,
                prompt_tokens=prompt_tokens,
            ),
            self.accept_hold_s,
        )

    async def _stream(self, req: GenerateRequest, er: EngineRequest, stream: RequestStream, hop: _Trace) -> None:
        index = len(er.resumed_output_ids)
        first: tuple[StreamDelta, int] | None = None
        async for d in stream:
            on_ack = None
            if first is None:
                first = (d, time.time_ns())
                on_ack = functools.partial(_stamp_ack, hop)
            if d.finished:  # the spans once the last token has left, not in a token gap
                on_ack = functools.partial(self._last_token_left, hop, *first, stamp=on_ack is not None)
            self.telemetry.add_tokens(len(d.token_ids))
            final = d.metrics
            self.outbox.put(
                req.reply_partition,
                Delta(
                    request_id=req.request_id,
                    attempt=req.attempt,
                    index=index,
                    token_ids=d.token_ids,
                    text=d.text,
                    logprobs=d.logprobs,
                    finish_reason=d.finish_reason,
                    token_texts=d.token_texts,
                    prompt_tokens=stream.num_prompt_tokens if d.finished else None,
                    cached_tokens=final.num_cached_tokens if final else None,
                ),
                on_ack,
            )
            index += len(d.token_ids)
            if final is not None:
                self.telemetry.finished(request_timing(req.request_id, er.req_class, er.slo, final))

    def _last_token_left(self, hop: _Trace, first: StreamDelta, first_ns: int, stamp: bool) -> None:
        """The last token's batch was acknowledged (`stamp`: it was the first's too): the spans."""
        if stamp:
            _stamp_ack(hop)
        hop.record(self.tracing, first, first_ns)

    def _forget(self, req: GenerateRequest) -> None:
        if self._tasks.get(req.request_id) is asyncio.current_task():
            del self._tasks[req.request_id]
            del self._requests[req.request_id]
        self._finished.append((time.monotonic(), f"{req.request_id}:{req.attempt}"))


def _stamp_ack(hop: _Trace) -> None:
    """The first token's batch was acknowledged: only its time, the spans come at the end."""
    hop.first_acked_ns = time.time_ns()
