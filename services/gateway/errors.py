"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from shared.openai_api import json_input

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI's type for a bad key (code "invalid_api_key")
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
    504: "timeout",
    500: "internal_error",
}


class APIError(Exception):
    """An error answer. `headers`: e.g. `Retry-After` on a 429, `WWW-Authenticate` on a 401;
    `type_`: overrides the status's default type (OpenAI's rate limits say `requests`/`tokens`)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}
        self.type = type_ or _TYPES.get(status, "api_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def failed_error(event) -> APIError:
    """A worker's or the scheduler's `Failed` event as the answer; a 429 carries `Retry-After`
    (whole seconds, rounded up) when the event says when to retry."""
    headers = {}
    if event.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(event.retry_after_s)))
    return APIError(event.status, event.message, code=event.code, headers=headers)


def parse_json_body(raw: bytes, model: type[BaseModel], limit: int) -> BaseModel:
    """A request body as `model`, or the OpenAI-shaped 413/400 saying what is wrong with it."""
    if len(raw) > limit:
        raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    try:
        data = json_input.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(
            400, f"{param}: {err['msg']}" if param else err["msg"], param=param, code="invalid_value"
        ) from None


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app can answer is OpenAI's error object: ours (`APIError`), FastAPI's
    parameter validation (a 400 naming the parameter, never FastAPI's 422 `detail` list),
    Starlette's (unknown route 404, wrong method 405, malformed multipart 400) and anything
    unexpected (a 500 that names no internals; the traceback goes to the log)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _bad_parameter(_: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in err["loc"]]
        param = loc[-1] if loc else None
        where = f"{loc[0]} parameter {param!r}: " if len(loc) >= 2 else ""
        return APIError(400, f"{where}{err['msg']}", param=param, code="invalid_value").response()

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}").response()
