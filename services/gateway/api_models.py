"""The shapes of the gateway's HTTP answers (and of the bodies it reads by hand), for `/openapi.json`.

The handlers build their answers as dicts (`shared/openai_api/responses.py`,
`shared/batchstore/objects.py`) and parse their bodies themselves (depth-bounded JSON, OpenAI
errors); these models only describe them, so clients can generate code. They are kept honest
by the fuzzing test (`tests/services/test_fuzzing.py`), which validates every answer it gets
against them (schemathesis' `response_schema_conformance`). Extra fields are allowed, as
OpenAI adds fields too.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# -- errors ----------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx answer (OpenAI's error shape)."""

    error: ErrorDetail


# -- completions -----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(ge=0)


class Usage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    """A non-streamed chat answer; with `"stream": true` the answer is `text/event-stream`
    of `chat.completion.chunk` objects ending with `data: [DONE]`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    service_tier: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict | None = None
    finish_reason: str


class Completion(BaseModel):
    """A non-streamed legacy completion (`text_completion` chunks when streamed)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    service_tier: str | None = None
    choices: list[CompletionChoice]
    usage: Usage


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    dtype: str | None = None
    device: str | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Health(BaseModel):
    """`/health`: 200 when the gateway runs and sees a worker, else 503 with the same body."""

    status: Literal["ok", "unavailable"]
    workers: int
    models: list[str]
    gateway_id: str


# -- files and batches -----------------------------------------------------------------------


class FileUpload(BaseModel):
    """`POST /v1/files` (multipart/form-data): a JSONL batch input file."""

    file: bytes
    purpose: Literal["batch"]


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchCreateRequest(BaseModel):
    """`POST /v1/batches`. `completion_window`: `24h`, or shorter (`30m`, `90s`: a Tandem extension)."""

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: str = Field(pattern=r"^\d+[smh]$", examples=["24h"])
    metadata: dict[str, str] | None = Field(None, max_length=16)


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: Literal[
        "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
    ]
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


# -- sessions and keys -----------------------------------------------------------------------


class TypingAccepted(BaseModel):
    """`hint`: `sent`, or `debounced` (a hint for this session went out moments ago)."""

    session_id: str
    hint: Literal["sent", "debounced"]


class SessionStats(BaseModel):
    """Per live worker, its kept-KV counters (as its heartbeat carries them)."""

    workers: dict[str, dict[str, float]]


class ApiKeyObject(BaseModel):
    id: str
    object: Literal["api_key"]
    name: str
    created_at: int
    revoked_at: int | None
    requests_per_s: float | None
    tokens_per_min: int | None
    batch_quota: int | None
    classes: list[Literal["rt", "be"]]
    admin: bool


class ApiKeyCreated(ApiKeyObject):
    key: str = Field(description="the new key; shown this once, only its hash is stored")


class ApiKeyList(BaseModel):
    object: Literal["list"]
    data: list[ApiKeyObject]
