"""Typing hints over HTTP and WebSocket: `POST /v1/sessions/{id}/typing` and
`/v1/sessions/{id}/events`. Both feed `HintPublisher` (debounced, one hint per burst).
`GET /v1/sessions/stats`: the workers' kept-KV counters, as their heartbeats report them.

HTTP body: `{"expected_arrival_s": float}` or empty → 202 `{"session_id", "hint": "sent"|"debounced"}`.
WebSocket: the client sends `{"type": "keystroke"|"typing", "expected_arrival_s"?: float}` frames;
each gets `{"type": "hint", "status": "sent"|"debounced"}`; a bad frame gets
`{"type": "error", "message": ...}` and the socket stays open.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.gateway.auth import caller_of, ws_subprotocol
from services.gateway.core import GatewayCore
from services.gateway.errors import APIError, parse_json_body
from services.gateway.hints import HintPublisher
from shared.openai_api import json_input
from shared.schemas.sessions import check_session_id

log = logging.getLogger(__name__)
MAX_HINT_BODY_BYTES = 4096


class TypingBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    expected_arrival_s: float | None = Field(None, ge=0, le=3600)


class TypingEvent(TypingBody):
    type: str

    def check(self) -> None:
        if self.type not in ("keystroke", "typing"):
            raise ValueError(f"type must be 'keystroke' or 'typing', not {self.type!r}")


def register_sessions_api(app: FastAPI, core: GatewayCore) -> None:
    api = _SessionsAPI(core)
    # `:path` so an id with an encoded '/' still reaches the handler (and gets a proper error).
    app.post("/v1/sessions/{session_id:path}/typing", status_code=202)(api.typing)
    app.websocket("/v1/sessions/{session_id:path}/events")(api.events)
    app.get("/v1/sessions/stats")(api.stats)


class _SessionsAPI:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        self.publisher = HintPublisher(core.kafka, core.topics.advisory.name, core.settings.typing_debounce_s)
        self.m_hints = core.metrics.counter(
            "gateway_typing_hints_total", "typing events received", ("source", "status")
        )

    async def stats(self) -> dict:
        """Every live worker's kept-KV counters, from its heartbeats (the sessions benchmark reads them)."""
        return {"workers": {hb.worker_id: hb.session_stats for hb in self.core.workers.heartbeats()}}

    async def typing(self, session_id: str, request: Request) -> JSONResponse:
        sid = _session_id(session_id)
        body = _parse_body(await request.body())
        status = await self._hint(caller_of(request).session_id(sid), body.expected_arrival_s, "http")
        return JSONResponse({"session_id": sid, "hint": status}, status_code=202)

    async def events(self, websocket: WebSocket, session_id: str) -> None:
        await websocket.accept(subprotocol=ws_subprotocol(websocket))
        try:
            sid = caller_of(websocket).session_id(check_session_id(session_id))
        except ValueError as exc:
            await websocket.send_json({"type": "error", "message": str(exc)})
            await websocket.close(code=1008)
            return
        try:
            while True:
                frame = await websocket.receive()
                if frame["type"] == "websocket.disconnect":
                    return
                await websocket.send_json(await self._on_frame(sid, frame.get("text")))
        except WebSocketDisconnect:
            return

    async def _on_frame(self, sid: str, text: str | None) -> dict:
        if text is None:
            return {"type": "error", "message": "send JSON text frames, not binary ones"}
        try:
            data = json_input.loads(text)
        except ValueError as exc:
            return {"type": "error", "message": f"not valid JSON: {exc}"}
        try:
            event = TypingEvent.model_validate(data)
            event.check()
        except ValueError as exc:  # a pydantic ValidationError, or a bad type
            return {"type": "error", "message": _message(exc)}
        try:
            return {"type": "hint", "status": await self._hint(sid, event.expected_arrival_s, "websocket")}
        except APIError as exc:
            return {"type": "error", "message": exc.message}

    async def _hint(self, sid: str, expected_arrival_s: float | None, source: str) -> str:
        try:
            status = await self.publisher.hint(sid, expected_arrival_s, source)
        except Exception:  # noqa: BLE001 (the broker is away: the client may retry)
            log.warning("typing hint not published", exc_info=True)
            raise APIError(503, "the hint could not be published; retry later", code="unavailable") from None
        self.m_hints.labels(source, status).inc()
        return status


def _session_id(session_id: str) -> str:
    try:
        return check_session_id(session_id)
    except ValueError as exc:
        raise APIError(400, str(exc), param="session_id", code="invalid_value") from None


def _parse_body(raw: bytes) -> TypingBody:
    if len(raw) <= MAX_HINT_BODY_BYTES and not raw.strip():  # the expected arrival is optional, so is the body
        return TypingBody()
    return parse_json_body(raw, TypingBody, MAX_HINT_BODY_BYTES)


def _message(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        return f"{loc}: {err['msg']}" if loc else err["msg"]
    return str(exc)
