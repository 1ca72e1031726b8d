"""The HTTP API: OpenAI-compatible completions (SSE and plain), models, health, metrics."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager

from aiokafka.errors import KafkaError
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from services.gateway.auth import Authenticator, Caller, caller_of, raise_refusal
from services.gateway.batch_api import register_batch_api
from services.gateway.core import GatewayCore
from services.gateway.database import GatewayDatabase
from services.gateway.errors import APIError, failed_error, install_error_handlers, parse_json_body
from services.gateway.keys_api import register_keys_api
from services.gateway.openapi import install_openapi
from services.gateway.page import register_chat_page
from services.gateway.sessions_api import register_sessions_api
from services.gateway.settings import GatewaySettings
from services.gateway.streams import RequestStream
from shared.openai_api.models import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from shared.openai_api.responses import shaper_for, sse, usage
from shared.openai_api.translate import ReplyTo, to_generate_request
from shared.schemas.requests import GenerateRequest
from shared.schemas.results import Accepted, Delta, Failed
from shared.schemas.sessions import check_session_id
from shared.tracing import Tracing

log = logging.getLogger(__name__)


def create_app(settings: GatewaySettings) -> FastAPI:
    core = GatewayCore(settings)
    db = GatewayDatabase(settings.resolved_database_url())
    auth = Authenticator(settings, db)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await auth.start()
        await core.start()
        yield
        await core.stop()
        await db.close()

    # The auth dependency runs before every route and acts on /v1 paths (services/gateway/auth.py).
    app = FastAPI(title="Tandem", lifespan=lifespan, dependencies=[Depends(auth)])
    app.state.core = core
    api = _Handlers(core, auth)

    install_error_handlers(app)  # every error is OpenAI's error object
    app.post("/v1/chat/completions")(api.chat)
    app.post("/v1/completions")(api.completions)
    app.get("/v1/models")(api.models)
    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics)
    register_batch_api(app, settings, db, core.notify_batch)  # /v1/files, /v1/batches (the batch store; docs/batch.md)
    register_sessions_api(app, core)  # typing hints (docs/sessions.md)
    register_keys_api(app, db, auth)  # /v1/keys: key management for admin keys
    register_chat_page(app)  # the chat page at / (services/gateway/static)
    install_openapi(app)  # /openapi.json declares every body, answer and link (openapi.py)
    return app


class _Handlers:
    def __init__(self, core: GatewayCore, auth: Authenticator) -> None:
        self.core = core
        self.auth = auth
        m = core.metrics
        self.m_requests = m.counter("gateway_requests_total", "requests answered", ("endpoint", "req_class", "status"))
        self.m_ttft = m.histogram("gateway_ttft_seconds", "time to first token seen at the gateway", ("req_class",))
        self.m_e2e = m.histogram("gateway_e2e_seconds", "request latency at the gateway", ("req_class",))
        self.m_tokens = m.counter("gateway_output_tokens_total", "tokens streamed to clients", ("req_class",))
        self.m_inflight = m.gauge("gateway_inflight", "requests in flight")
        self.m_resumed = m.gauge("gateway_resumed_requests", "requests resumed on another worker since start")

    # -- endpoints -----------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        return await self._serve(request, body)

    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        return await self._serve(request, body)

    async def models(self) -> dict:
        data = [
            {
                "id": name,
                "object": "model",
                "created": int(hb.started_at),
                "owned_by": "tandem",
                "max_model_len": hb.max_model_len,
                "dtype": hb.dtype,
                "device": hb.device,
            }
            for name, hb in sorted(self.core.workers.models().items())
        ]
        return {"object": "list", "data": data}

    async def health(self) -> JSONResponse:
        live = self.core.workers.heartbeats()
        body = {
            "status": "ok" if live and self.core.ready else "unavailable",
            "workers": len(live),
            "models": sorted({hb.model for hb in live}),
            "gateway_id": self.core.gateway_id,
        }
        return JSONResponse(body, status_code=200 if live and self.core.ready else 503)

    async def metrics(self) -> Response:
        self.m_inflight.set(len(self.core.streams))
        self.m_resumed.set(self.core.streams.resumed)
        data, content_type = self.core.metrics.render()
        return Response(data, media_type=content_type)

    # -- request handling ------------------------------------------------------------------

    async def _parse(self, request: Request, model: type[BaseModel]):
        limit = self.core.settings.max_body_bytes
        if int(request.headers.get("content-length") or 0) > limit:
            raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        body = parse_json_body(await request.body(), model, limit)
        bad = body.unsupported()
        if bad:
            raise APIError(400, f"'{bad}' is not supported by this server", param=bad, code="unsupported_parameter")
        return body

    def _admit(self, body, request: Request, caller: Caller) -> str:
        req_class = caller.request_class(_asked_class(body, request))
        if caller.key is not None:
            raise_refusal(self.auth.limiter.admit_tokens(caller.key))
        models = self.core.workers.models()
        if not models:
            raise APIError(503, "no workers are available", code="no_workers")
        if body.model not in models:
            raise APIError(
                404,
                f"The model '{body.model}' does not exist; available: {sorted(models)}",
                param="model",
                code="model_not_found",
            )
        if len(self.core.streams) >= self.core.settings.max_inflight:
            raise APIError(
                429, "too many requests in flight; retry later", code="overloaded", headers={"Retry-After": "1"}
            )
        return req_class

    def _build(self, body: OpenAIRequest, req_class: str, request: Request, caller: Caller) -> GenerateRequest:
        core = self.core
        session = request.headers.get("x-session-id") or (body.tandem.session_id if body.tandem else None)
        if session is not None:
            session = caller.session_id(check_session_id(session))
        slo = body.slo()
        if req_class == "rt" and slo.ttft_ms is None and slo.tpot_ms is None:
            slo = slo.model_copy(update={"ttft_ms": core.settings.rt_ttft_ms, "tpot_ms": core.settings.rt_tpot_ms})
        return to_generate_request(
            body,
            request_id=request.headers.get("x-request-id") or uuid.uuid4().hex,
            reply_to=ReplyTo(core.gateway_id, core.reply_partition),
            req_class=req_class,
            slo=slo,
            session_id=session,
            cache_salt=caller.cache_salt,
        )

    async def _serve(self, request: Request, body: OpenAIRequest) -> Response:
        accepted_ns = time.time_ns()
        caller = caller_of(request)
        req_class = self._admit(body, request, caller)
        try:
            gen = self._build(body, req_class, request, caller)
        except (ValidationError, ValueError) as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        if self._is_open(gen.request_id):
            raise APIError(400, f"request id {gen.request_id!r} is already in flight", code="duplicate_request_id")
        stream = self.core.streams.open(gen)
        stream.trace = self.core.tracing.start_request(request.headers)
        ctx = _Ctx(self, stream, body, time.perf_counter(), caller)
        try:
            await self._publish(gen, accepted_ns)
            await ctx.wait_accepted()
        except BaseException:
            ctx.close(completed=False)
            raise
        if body.stream:
            return StreamingResponse(
                ctx.sse(),
                media_type="text/event-stream",
                headers={
                    "X-Request-Id": gen.request_id,
                    "X-Tandem-Worker": stream.worker_id or "",
                    "Cache-Control": "no-cache",
                    **Tracing.http_headers(stream.trace),
                },
            )
        return await ctx.collect(request)

    async def _publish(self, gen, accepted_ns: int) -> None:
        """Publish the request; a broker that refuses it (tansu answers some produces with an
        error for a while after a restart) is a 503 the client can retry, not a 500."""
        try:
            await self.core.submit(gen, accepted_ns)
        except KafkaError as exc:
            raise APIError(
                503,
                f"the message broker refused the request ({exc}); retry it",
                code="broker_unavailable",
                headers={"Retry-After": "1"},
            ) from None

    def _is_open(self, request_id: str) -> bool:
        return request_id in self.core.streams._streams  # noqa: SLF001


def _asked_class(body, request: Request) -> str | None:
    """The class the request names: `X-Tandem-Class`, else `service_tier` "flex" (BE) or
    "priority" (RT); None when it names none ("auto", "default", absent)."""
    header = request.headers.get("x-tandem-class")
    if header is not None:
        if header.lower() not in ("rt", "be"):
            raise APIError(400, "X-Tandem-Class must be 'rt' or 'be'", param="X-Tandem-Class", code="invalid_value")
        return header.lower()
    return {"flex": "be", "priority": "rt"}.get(body.service_tier or "")


class _Ctx:
    """One request's life at the gateway, from submission to the last byte."""

    def __init__(self, h: _Handlers, stream: RequestStream, body: OpenAIRequest, t0: float, caller: Caller) -> None:
        self.h, self.stream, self.body, self.t0, self.caller = h, stream, body, t0, caller
        self.cls = stream.request.req_class
        rid = stream.request.request_id
        self.shaper = shaper_for(body.kind, rid, int(time.time()), body.model, body.service_tier)
        self.first_token_seen = False
        self.closed = False
        self.cached_tokens: int | None = None
        self.early: Delta | None = None  # a first event that was a delta (`wait_accepted`)

    @property
    def endpoint(self) -> str:
        return "chat" if self.body.kind == "chat" else "completions"

    def _timeout(self, first: bool) -> float:
        s = self.h.core.settings
        return s.first_event_timeout_s if first and self.cls == "rt" else s.request_timeout_s

    async def _next(self, first: bool = False):
        try:
            async with asyncio.timeout(self._timeout(first)):  # not wait_for: see shared/aio.py
                return await self.stream.events.get()
        except TimeoutError:
            if first:  # a request nobody served: named, so its path can be followed in the logs
                log.warning(
                    "no result event within %.0fs of submission (attempt %d): 503 no_capacity",
                    self._timeout(first),
                    self.stream.attempt,
                    extra={"request_id": self.stream.request.request_id},
                )
                raise APIError(503, "no worker accepted the request in time", code="no_capacity") from None
            raise APIError(504, "the request timed out", code="timeout") from None

    async def wait_accepted(self) -> None:
        """Until the first event. It is normally the worker's `Accepted`, but a delta can come
        first: a broker restart loses the records it held unread (the `Accepted` among them) while
        the worker's later records, sent again by its producer, reach the new broker. Such a delta
        is kept for `_deltas` (it used to be taken for the acceptance and dropped: the client's
        text then lacked its first chunk, a gap `tandem chaos` counted, and a delta that also
        finished the request left the response waiting out `request_timeout_s`)."""
        event = await self._next(first=True)
        if isinstance(event, Failed):
            self.close(completed=True, status=str(event.status))
            raise failed_error(event)
        if isinstance(event, Delta):
            self.early = event

    async def _deltas(self):
        """Deltas until the finishing one; Accepted events of resumed attempts are skipped."""
        while True:
            event = self.early if self.early is not None else await self._next()
            self.early = None
            if isinstance(event, Accepted):
                continue
            if isinstance(event, Failed):
                raise failed_error(event)
            self._observe(event)
            yield event
            if event.finish_reason is not None:
                return

    def _observe(self, d: Delta) -> None:
        if not self.first_token_seen and d.token_ids:
            self.first_token_seen = True
            self.h.m_ttft.labels(self.cls).observe(time.perf_counter() - self.t0)
        self.h.m_tokens.labels(self.cls).inc(len(d.token_ids))
        if d.cached_tokens is not None:
            self.cached_tokens = d.cached_tokens

    def _trace_first_token(self, written_ns: int | None) -> None:
        """The first token's result-side hops (its Kafka hop from the worker, the SSE write from
        reading its batch to `written_ns`), at the stream's end: not in the first token gap."""
        if self.stream.first_batch_ns is None or written_ns is None:
            return
        sent, read = self.stream.first_batch_ns
        if sent is not None:
            self.h.core.tracing.hop("gateway.consume", self.stream.trace, sent, read)
        self.h.core.tracing.hop("gateway.sse_write", self.stream.trace, read, written_ns)

    def _usage(self) -> dict:
        return usage(self.stream.prompt_tokens or 0, len(self.stream.token_ids), self.cached_tokens)

    async def sse(self):
        completed, first_written_ns = False, None
        try:
            first = self.shaper.first_chunk()
            if first is not None:
                yield sse(first)
            try:
                async for d in self._deltas():
                    yield sse(self.shaper.delta_chunk(d, d.token_texts))
                    if d.index == 0 and d.token_ids:  # resumed here only once the server sent it
                        first_written_ns = time.time_ns()
            except APIError as exc:  # headers are sent: report in-band, as OpenAI does
                yield sse(exc.body())
                yield sse("[DONE]")
                return
            opts = self.body.stream_options
            if opts is not None and opts.include_usage:
                yield sse(self.shaper.usage_chunk(self._usage()))
            yield sse("[DONE]")
            completed = True
        finally:
            self._trace_first_token(first_written_ns)
            self.close(completed)

    async def collect(self, request: Request) -> JSONResponse:
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        collector = asyncio.ensure_future(self._collect_all())
        try:
            done, _ = await asyncio.wait({watcher, collector}, return_when=asyncio.FIRST_COMPLETED)
            if collector not in done:
                collector.cancel()
                self.close(completed=False)
                return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
            result = collector.result()
            self.close(completed=True)
            return JSONResponse(
                result,
                headers={
                    "X-Request-Id": self.stream.request.request_id,
                    "X-Tandem-Worker": self.stream.worker_id or "",
                    **Tracing.http_headers(self.stream.trace),
                },
            )
        except BaseException:
            self.close(completed=False)
            raise
        finally:
            watcher.cancel()

    async def _collect_all(self) -> dict:
        logprobs: list[float] = []
        texts: list[str] = []
        finish = "stop"
        async for d in self._deltas():
            logprobs.extend(d.logprobs or [])
            texts.extend(d.token_texts or [])
            finish = d.finish_reason or finish
        want_lp = self.stream.request.sampling.logprobs
        return self.shaper.final(self.stream.text, finish, logprobs if want_lp else None, texts, self._usage())

    def close(self, completed: bool, status: str | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        rid = self.stream.request.request_id
        self.h.core.streams.close(rid)
        if not completed:
            self.h.core.cancel_soon(rid)  # the worker aborts it and frees its KV
        if self.caller.key is not None:  # tokens/min: what the stream used, however it ended
            used = (self.stream.prompt_tokens or 0) + len(self.stream.token_ids)
            self.h.auth.limiter.charge_tokens(self.caller.key, used)
        status = status or ("200" if completed else "cancelled")
        if self.stream.trace is not None:
            self.stream.trace.set_attribute("http.status", status)
            self.stream.trace.end()
        self.h.m_requests.labels(self.endpoint, self.cls, status).inc()
        if status == "200":
            self.h.m_e2e.labels(self.cls).observe(time.perf_counter() - self.t0)


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
