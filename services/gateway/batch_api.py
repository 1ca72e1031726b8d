"""The OpenAI Files and Batches API (`/v1/files`, `/v1/batches`) on the gateway.

The gateway reads and writes the batch store (`shared/batchstore`, the database it shares
with the queue service) directly, through the store's API part: creating a batch is one row in
status `validating`, a cancel one conditional update to `cancelling`; the queue service does
the rest (see docs/batch.md for why the two share the database instead of talking over Kafka).

With API keys, every file and batch belongs to the key that created it (another key's ids are
404s), a batch needs a key that may send BE requests (its items run best-effort), and a key's
batch quota bounds the requests in its unfinished batches: a batch that would exceed it is a
429 (`batch_quota_exceeded`) and nothing is created.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from services.gateway.auth import Caller, caller_of
from services.gateway.database import GatewayDatabase
from services.gateway.errors import APIError
from services.gateway.settings import GatewaySettings
from shared.batchstore.api_store import BatchAPIStore, count_requests
from shared.batchstore.objects import batch_object, file_object, list_page
from shared.openai_api import json_input
from shared.openai_api.models import ENDPOINTS

FILE_PURPOSES = ("batch",)  # what clients may upload
MAX_WINDOW_S = 24 * 3600
_WINDOW = re.compile(r"^(\d+)([smh])$")
_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_window(window: object) -> int:
    """`24h` (OpenAI's only value); shorter windows (`90s`, `30m`, `2h`) are a Tandem extension."""
    m = _WINDOW.match(window) if isinstance(window, str) else None
    seconds = int(m.group(1)) * _UNITS[m.group(2)] if m else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise ValueError(f"completion_window must be '24h' (or a shorter duration like '30m'), not {window!r}")
    return seconds


BATCH_QUOTA_RETRY_S = 60  # a quota frees as batches finish: no exact time to promise


def register_batch_api(
    app: FastAPI, settings: GatewaySettings, db: GatewayDatabase, notify: Callable[[str, str], None]
) -> None:
    """`notify(batch_id, change)` tells the queue service that a batch was created or cancelled."""
    api = _BatchAPI(settings, db, notify)
    app.post("/v1/files")(api.upload)
    app.get("/v1/files")(api.list_files)
    app.get("/v1/files/{file_id}")(api.get_file)
    app.get("/v1/files/{file_id}/content")(api.file_content)
    app.delete("/v1/files/{file_id}")(api.delete_file)
    app.post("/v1/batches")(api.create_batch)
    app.get("/v1/batches")(api.list_batches)
    app.get("/v1/batches/{batch_id}")(api.get_batch)
    app.post("/v1/batches/{batch_id}/cancel")(api.cancel_batch)


class _BatchAPI:
    def __init__(self, settings: GatewaySettings, db: GatewayDatabase, notify: Callable[[str, str], None]) -> None:
        self.settings = settings
        self.db = db
        self.notify = notify

    async def store(self) -> BatchAPIStore:
        return BatchAPIStore(await self.db.get())

    # -- files -----------------------------------------------------------------------------

    async def upload(self, request: Request) -> dict:
        owner = caller_of(request).owner
        limit = self.settings.max_file_bytes
        if int(request.headers.get("content-length") or 0) > limit + 64 * 1024:
            raise APIError(413, f"file exceeds {limit} bytes", code="file_too_large")
        form = await request.form()
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose not in FILE_PURPOSES:
            raise APIError(
                400,
                f"purpose must be one of {list(FILE_PURPOSES)}, not {purpose!r}",
                param="purpose",
                code="invalid_value",
            )
        if upload is None or isinstance(upload, str):
            raise APIError(400, "a multipart 'file' part is required", param="file", code="missing_required_parameter")
        content = await upload.read()
        if len(content) > limit:
            raise APIError(413, f"file exceeds {limit} bytes", code="file_too_large")
        row = await (await self.store()).add_file(content, upload.filename or "upload.jsonl", purpose, owner)
        return file_object(row)

    async def list_files(
        self, request: Request, purpose: str | None = None, limit: int = 100, after: str | None = None
    ) -> dict:
        owner = caller_of(request).owner
        rows, more = await (await self.store()).list_files(purpose, _limit(limit, 10_000), after, owner)
        return list_page([file_object(r) for r in rows], more)

    async def get_file(self, file_id: str, request: Request) -> dict:
        return file_object(await self._file(file_id, caller_of(request).owner))

    async def file_content(self, file_id: str, request: Request) -> Response:
        row = await self._file(file_id, caller_of(request).owner)
        return Response(row.content, media_type="application/jsonl")

    async def delete_file(self, file_id: str, request: Request) -> dict:
        if not await (await self.store()).delete_file(file_id, caller_of(request).owner):
            raise APIError(404, f"No such File object: {file_id}", param="file_id", code="not_found")
        return {"id": file_id, "object": "file", "deleted": True}

    async def _file(self, file_id: str, owner: str | None):
        row = await (await self.store()).get_file(file_id, owner)
        if row is None:
            raise APIError(404, f"No such File object: {file_id}", param="file_id", code="not_found")
        return row

    # -- batches ---------------------------------------------------------------------------

    async def create_batch(self, request: Request) -> dict:
        caller = caller_of(request)
        caller.request_class("be")  # batch items run best-effort: a key without BE gets a 403
        body = await _json_object(request)
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if endpoint not in ENDPOINTS:
            raise APIError(
                400,
                f"endpoint must be one of {sorted(ENDPOINTS)}, not {endpoint!r}",
                param="endpoint",
                code="invalid_value",
            )
        try:
            window_s = parse_window(window)
        except ValueError as exc:
            raise APIError(400, str(exc), param="completion_window", code="invalid_value") from None
        metadata = body.get("metadata")
        if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= 16 and all(isinstance(v, str) for v in metadata.values())
        ):
            raise APIError(
                400, "metadata must be an object of at most 16 string values", param="metadata", code="invalid_value"
            )
        f = await self._input_file(body.get("input_file_id"), caller.owner)
        await self._check_quota(caller, f)
        row = await (await self.store()).add_batch(f.id, endpoint, window, window_s, metadata, caller.owner)
        self.notify(row.id, "created")
        return batch_object(row)

    async def _check_quota(self, caller: Caller, input_file) -> None:
        quota = None if caller.key is None else caller.key.limits.batch_quota
        if quota is None:
            return
        wanted = input_file.requests if input_file.requests is not None else count_requests(input_file.content)
        queued = await (await self.store()).unfinished_requests(caller.owner)
        if queued + wanted > quota:
            raise APIError(
                429,
                f"this batch has {wanted} requests and this API key's unfinished batches hold {queued}; its batch "
                f"quota is {quota} requests. Retry when some have finished.",
                code="batch_quota_exceeded",
                type_="requests",
                headers={"Retry-After": str(BATCH_QUOTA_RETRY_S)},
            )

    async def _input_file(self, file_id, owner: str | None):
        if not isinstance(file_id, str):
            raise APIError(400, "input_file_id is required", param="input_file_id", code="missing_required_parameter")
        row = await (await self.store()).get_file(file_id, owner)
        if row is None:
            raise APIError(404, f"No such File object: {file_id}", param="input_file_id", code="not_found")
        if row.purpose != "batch":
            raise APIError(
                400,
                f"file {file_id} has purpose {row.purpose!r}, not 'batch'",
                param="input_file_id",
                code="invalid_value",
            )
        return row

    async def get_batch(self, batch_id: str, request: Request) -> dict:
        return batch_object(await self._batch(batch_id, caller_of(request).owner))

    async def list_batches(self, request: Request, limit: int = 20, after: str | None = None) -> dict:
        rows, more = await (await self.store()).list_batches(_limit(limit, 100), after, caller_of(request).owner)
        return list_page([batch_object(r) for r in rows], more)

    async def cancel_batch(self, batch_id: str, request: Request) -> dict:
        owner = caller_of(request).owner
        store = await self.store()
        row = await self._batch(batch_id, owner)
        if await store.request_cancel(batch_id, owner):
            self.notify(row.id, "cancelling")
        else:
            row = await self._batch(batch_id, owner)
            if row.status not in ("cancelling", "cancelled"):
                raise APIError(409, f"cannot cancel a batch with status {row.status!r}", code="batch_not_cancellable")
        return batch_object(await self._batch(row.id, owner))

    async def _batch(self, batch_id: str, owner: str | None):
        row = await (await self.store()).get_batch(batch_id, owner)
        if row is None:
            raise APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
        return row


def _limit(limit: int, most: int) -> int:
    if not 1 <= limit <= most:
        raise APIError(400, f"limit must be between 1 and {most}", param="limit", code="invalid_value")
    return limit


async def _json_object(request: Request) -> dict:
    try:
        body = json_input.loads(await request.body())
    except ValueError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return body
