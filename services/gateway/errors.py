"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""
from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_exceeded", 503: "service_unavailable", 504: "timeout", 500: "internal_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)
