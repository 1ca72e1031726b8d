"""Up-front validation of a batch input file (pure: bytes in, lines or errors out).

Every line must be a JSON object `{"custom_id", "method": "POST", "url", "body"}` whose url is the
batch's endpoint and whose body is a valid request for it (the same pydantic models the
synchronous endpoints use). Any error fails the whole batch before anything runs, with OpenAI's
error entries: `{"code", "message", "param", "line"}` (1-based line numbers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError

from shared.batchstore.run_store import BatchLine
from shared.openai_api import json_input
from shared.openai_api.models import ENDPOINTS

MAX_CUSTOM_ID = 512


@dataclass
class Validated:
    lines: list[BatchLine] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)  # the first `max_errors`
    error_count: int = 0


def validate_input(
    data: bytes, endpoint: str, *, max_lines: int, max_errors: int = 100, models: set[str] | None = None
) -> Validated:
    """`models`: the model ids live workers serve, or None to skip that check."""
    out = Validated()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        _error(out, max_errors, "invalid_file", f"the file is not UTF-8: {exc}", None, None)
        return out
    raw_lines = [(i, s) for i, s in enumerate(text.splitlines(), start=1) if s.strip()]
    if not raw_lines:
        _error(out, max_errors, "empty_file", "the input file has no requests", None, None)
    if len(raw_lines) > max_lines:
        _error(
            out,
            max_errors,
            "too_many_lines",
            f"the input file has {len(raw_lines)} requests; at most {max_lines} are allowed",
            None,
            None,
        )
        return out
    seen: set[str] = set()
    for number, raw in raw_lines:
        line = _check_line(out, max_errors, number, raw, endpoint, seen, models)
        if line is not None:
            out.lines.append(line)
    return out


def _check_line(
    out: Validated, max_errors: int, number: int, raw: str, endpoint: str, seen: set[str], models: set[str] | None
) -> BatchLine | None:
    def fail(code: str, message: str, param: str | None = None) -> None:
        _error(out, max_errors, code, message, param, number)

    try:
        obj = json_input.loads(raw)
    except ValueError as exc:
        return fail("invalid_json_line", f"this line is not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return fail("invalid_json_line", "each line must be a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return fail("missing_required_parameter", "custom_id is required (a non-empty string)", "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID:
        return fail("invalid_value", f"custom_id is longer than {MAX_CUSTOM_ID} characters", "custom_id")
    if custom_id in seen:
        return fail("duplicate_custom_id", f"custom_id {custom_id!r} appears more than once", "custom_id")
    seen.add(custom_id)
    if obj.get("method", "POST") != "POST":
        return fail("invalid_value", "method must be POST", "method")
    if obj.get("url") != endpoint:
        return fail("invalid_url", f"url must be the batch's endpoint {endpoint!r}, not {obj.get('url')!r}", "url")
    problem = _body_problem(obj.get("body"), endpoint, models)
    if problem is not None:
        return fail(problem[0], problem[1], problem[2])
    return BatchLine(number, custom_id, obj["body"])


def _body_problem(body, endpoint: str, models: set[str] | None) -> tuple[str, str, str | None] | None:
    if not isinstance(body, dict):
        return "invalid_request", "body must be a JSON object", "body"
    try:
        parsed = ENDPOINTS[endpoint].model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        return "invalid_request", f"body.{param}: {err['msg']}" if param else err["msg"], f"body.{param}"
    bad = parsed.unsupported()
    if bad:
        return "unsupported_parameter", f"'{bad}' is not supported by this server", f"body.{bad}"
    if parsed.stream:
        return "invalid_request", "stream is not supported in a batch", "body.stream"
    if models is not None and parsed.model not in models:
        return (
            "model_not_found",
            f"the model {parsed.model!r} does not exist; available: {sorted(models)}",
            "body.model",
        )
    return None


def _error(out: Validated, max_errors: int, code: str, message: str, param: str | None, line: int | None) -> None:
    out.error_count += 1
    if len(out.errors) < max_errors:
        out.errors.append({"code": code, "message": message, "param": param, "line": line})
