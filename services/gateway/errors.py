"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from shared.openai_api import json_input

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI's type for a bad key (code "invalid_api_key")
    403: "permission_error",
    404: "invalid_request_error",
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
