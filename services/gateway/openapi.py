"""`/openapi.json` that tells the truth: every body, every answer, the errors, auth and links.

FastAPI derives a document from handler signatures, but our handlers read their bodies by hand
(depth-bounded JSON, OpenAI-shaped errors, multipart uploads), so it would declare no request
body at all and only a bare 200. This module declares each operation from one table
(`OPERATIONS`): its id, its body's model, its success answer's model, and OpenAPI `links` that
chain upload -> batch create -> retrieve -> cancel -> output file content (and key create ->
revoke), so generated clients get types and fuzzers reach the follow-up operations with real
ids. Every operation also answers `default`: OpenAI's error object; `/v1` operations need the
bearer key once any key exists (services/gateway/auth.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from services.gateway import api_models as m
from services.gateway.keys_api import KeyCreateRequest
from services.gateway.sessions_api import TypingBody
from shared.openai_api.models import ChatCompletionRequest, CompletionRequest

JSON = "application/json"
DESCRIPTION = (
    "Tandem's OpenAI-compatible API (chat, completions, models, files, batches) and its extensions "
    "(sessions, API keys). Errors are OpenAI's error object; /v1 needs `Authorization: Bearer <key>` "
    "once any API key exists."
)


@dataclass(frozen=True)
class Operation:
    operation_id: str
    summary: str
    ok: type[BaseModel] | None  # the success answer's model (None: `ok_content` says what it is)
    body: type[BaseModel] | None = None
    body_content: str = JSON
    body_required: bool = True
    ok_status: str = "200"
    ok_content: dict = field(default_factory=dict)  # extra media types of the success answer
    links: dict = field(default_factory=dict)


def _param_link(operation_id: str, **params: str) -> dict:
    return {"operationId": operation_id, "parameters": params}


_SSE = {"text/event-stream": {"schema": {"type": "string", "description": "chunks, then `data: [DONE]`"}}}

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("/v1/chat/completions", "post"): Operation(
        "createChatCompletion", "Chat completion (streamed with `stream: true`)", m.ChatCompletion,
        body=ChatCompletionRequest, ok_content=_SSE,
    ),
    ("/v1/completions", "post"): Operation(
        "createCompletion", "Legacy completion (streamed with `stream: true`)", m.Completion,
        body=CompletionRequest, ok_content=_SSE,
    ),
    ("/v1/models", "get"): Operation("listModels", "The models live workers serve", m.ModelList),
    ("/health", "get"): Operation("health", "200 when a worker is live, else 503 (same body)", m.Health),
    ("/metrics", "get"): Operation(
        "metrics", "Prometheus metrics", None, ok_content={"text/plain": {"schema": {"type": "string"}}}
    ),
    ("/v1/files", "post"): Operation(
        "uploadFile", "Upload a JSONL batch input file", m.FileObject,
        body=m.FileUpload, body_content="multipart/form-data",
        links={
            "CreateBatch": {
                "operationId": "createBatch",
                "requestBody": {
                    "input_file_id": "$response.body#/id",
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            },
            "RetrieveFile": _param_link("retrieveFile", file_id="$response.body#/id"),
            "DownloadFile": _param_link("downloadFile", file_id="$response.body#/id"),
            "DeleteFile": _param_link("deleteFile", file_id="$response.body#/id"),
        },
    ),
    ("/v1/files", "get"): Operation("listFiles", "This key's files, newest first", m.FileList),
    ("/v1/files/{file_id}", "get"): Operation("retrieveFile", "A file object", m.FileObject),
    ("/v1/files/{file_id}", "delete"): Operation("deleteFile", "Delete a file", m.FileDeleted),
    ("/v1/files/{file_id}/content", "get"): Operation(
        "downloadFile", "A file's content (JSONL)", None,
        ok_content={"application/jsonl": {"schema": {"type": "string"}}},
    ),
    ("/v1/batches", "post"): Operation(
        "createBatch", "Create a batch from an uploaded file", m.Batch, body=m.BatchCreateRequest,
        links={
            "RetrieveBatch": _param_link("retrieveBatch", batch_id="$response.body#/id"),
            "CancelBatch": _param_link("cancelBatch", batch_id="$response.body#/id"),
            "RetrieveInputFile": _param_link("retrieveFile", file_id="$response.body#/input_file_id"),
        },
    ),
    ("/v1/batches", "get"): Operation("listBatches", "This key's batches, newest first", m.BatchList),
    ("/v1/batches/{batch_id}", "get"): Operation(
        "retrieveBatch", "A batch object", m.Batch,
        links={
            "DownloadOutput": _param_link("downloadFile", file_id="$response.body#/output_file_id"),
            "DownloadErrors": _param_link("downloadFile", file_id="$response.body#/error_file_id"),
            "CancelBatch": _param_link("cancelBatch", batch_id="$response.body#/id"),
        },
    ),
    ("/v1/batches/{batch_id}/cancel", "post"): Operation(
        "cancelBatch", "Cancel a batch (409 once it is past cancelling)", m.Batch,
        links={"RetrieveBatch": _param_link("retrieveBatch", batch_id="$response.body#/id")},
    ),
    ("/v1/sessions/{session_id}/typing", "post"): Operation(
        "sessionTyping", "The user of a session started typing (a hint; body optional)", m.TypingAccepted,
        body=TypingBody, body_required=False, ok_status="202",
    ),
    ("/v1/sessions/stats", "get"): Operation("sessionStats", "Kept-KV counters per live worker", m.SessionStats),
    ("/v1/keys", "get"): Operation("listKeys", "API keys (admin keys only; never the secrets)", m.ApiKeyList),
    ("/v1/keys", "post"): Operation(
        "createKey", "Create an API key (admin keys only); the key is shown once", m.ApiKeyCreated,
        body=KeyCreateRequest,
        links={"RevokeKey": _param_link("revokeKey", key_id="$response.body#/id")},
    ),
    ("/v1/keys/{key_id}", "delete"): Operation("revokeKey", "Revoke an API key (admin keys only)", m.ApiKeyObject),
}  # fmt: skip

_MODELS: tuple[type[BaseModel], ...] = (m.ErrorResponse,)


def install_openapi(app: FastAPI) -> None:
    """Replace the app's generated document with `build_openapi`'s (built once, on first request)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi


def build_openapi(app: FastAPI) -> dict:
    doc = get_openapi(title=app.title, version="1", routes=app.routes, description=DESCRIPTION)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for stale in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422: we answer 400 instead
        schemas.pop(stale, None)
    doc["components"]["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer", "description": "an API key from `tandem keys create`"}
    }
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            spec = OPERATIONS.get((path, method))
            if spec is None:
                raise RuntimeError(f"{method.upper()} {path} has no entry in services/gateway/openapi.py")
            _declare(op, spec, schemas)
            if path.startswith("/v1/"):
                op["security"] = [{"bearer": []}]
    for model in _MODELS:
        _ref(model, schemas)
    return doc


def _declare(op: dict, spec: Operation, schemas: dict) -> None:
    op["operationId"], op["summary"] = spec.operation_id, spec.summary
    if spec.body is not None:
        op["requestBody"] = {
            "required": spec.body_required,
            "content": {spec.body_content: {"schema": _ref(spec.body, schemas)}},
        }
    content = dict(spec.ok_content)
    if spec.ok is not None:
        content = {JSON: {"schema": _ref(spec.ok, schemas)}, **content}
    ok: dict = {"description": spec.summary, "content": content}
    if spec.links:
        ok["links"] = spec.links
    error = {"description": "an error (OpenAI's shape)", "content": {JSON: {"schema": _ref(m.ErrorResponse, schemas)}}}
    op["responses"] = {spec.ok_status: ok, "default": error}
    if spec.operation_id == "health":
        op["responses"]["503"] = {
            "description": "no live worker",
            "content": {JSON: {"schema": _ref(m.Health, schemas)}},
        }


def _ref(model: type[BaseModel], schemas: dict) -> dict:
    """`model`'s schema under components (with the models it uses), as a `$ref`."""
    if model.__name__ not in schemas:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}
