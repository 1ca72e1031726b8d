"""Rows as OpenAI returns them: `file` and `batch` objects, and list pages."""

from __future__ import annotations

import json
from collections.abc import Sequence

from shared.batchstore.db import BatchRow, FileRow

CANCELLABLE = frozenset({"validating", "in_progress"})
UNFINISHED = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
_TIMESTAMPS = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


def file_object(row: FileRow) -> dict:
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": row.created_at,
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_object(row: BatchRow) -> dict:
    obj = {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "errors": _json(row.errors_json),
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
    }
    obj.update({name: getattr(row, name) for name in _TIMESTAMPS})
    obj["request_counts"] = {"total": row.total, "completed": row.completed, "failed": row.failed}
    obj["metadata"] = _json(row.metadata_json)
    return obj


def list_page(data: Sequence[dict], has_more: bool) -> dict:
    return {
        "object": "list",
        "data": list(data),
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def errors_object(errors: Sequence[dict], total: int) -> dict:
    """OpenAI's `errors` field of a failed batch; when errors were capped, the last entry says how many."""
    data = list(errors)
    if total > len(data):
        data.append(
            {
                "code": "too_many_errors",
                "message": f"{total - len(data)} more errors not listed",
                "param": None,
                "line": None,
            }
        )
    return {"object": "list", "data": data}


def _json(text: str | None):
    return None if text is None else json.loads(text)
