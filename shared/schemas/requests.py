"""`requests.rt` / `requests.be` and per-worker dispatch: one generation request.

The gateway (for an HTTP request) and the queue service (for a batch item) translate an OpenAI
body into this (`shared/openai_api/translate.py`); the scheduler forwards it to a worker
(adding `kv_source` for a session turn that moves); the worker tokenizes (chat template or raw
prompt). A resumed request (its first worker died)
is the same request with `attempt + 1` and the tokens the client already has in
`resume_token_ids`: they become part of the prompt, so the stream continues where it stopped.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.schemas.base import WireModel
from shared.schemas.sessions import KVSourceRef

RequestClassName = Literal["rt", "be"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    role: str
    content: str


class SamplingOptions(BaseModel):
    """The engine's `SamplingParams`, as they travel (validated again by the engine)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int | None = None  # None: up to the model's context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class SLOTargets(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)


class GenerateRequest(WireModel):
    request_id: str
    attempt: int = 0  # bumped on every re-placement; workers and the gateway key on (id, attempt)
    gateway_id: str  # the owner's id: a gateway's, or the queue service's for batch items
    reply_partition: int  # the results-topic partition the owner (gateway or queue service) reads
    model: str
    kind: Literal["chat", "completion"]
    messages: list[ChatMessage] | None = None  # chat
    prompt: str | list[int] | None = None  # completion: text or token ids
    sampling: SamplingOptions = SamplingOptions()
    req_class: RequestClassName = "rt"
    slo: SLOTargets = SLOTargets()
    session_id: str | None = None
    # Set by the scheduler when a session turn goes to a worker that may not hold its KV: where
    # to pull it from (the worker pulls or recomputes, whichever its cost model says is faster).
    kv_source: KVSourceRef | None = None
    created_at: float  # wall-clock seconds when it was built (time.time())
    resume_token_ids: list[int] = Field(default_factory=list)
    metadata: dict[str, str] = Field(default_factory=dict)  # e.g. batch id / custom_id for batch items
    # The caller's API key's prefix-cache salt, set by the gateway or the queue service (never
    # from a client's body): the engine's block hashes start from it, so only requests of the
    # same key share cached KV (docs/services.md, "API keys"). None: no key (an
    # open stack), the shared cache. Added in schema 1 as an optional field (base.py's rule): a
    # worker older than it ignores it and serves the request unsalted, so upgrade workers first.
    cache_salt: str | None = None
    # The epoch of the worker the scheduler dispatched this to (`Heartbeat.epoch`): a worker that
    # was fenced at that epoch drops it (the scheduler has re-placed it). None: not dispatched yet.
    worker_epoch: int | None = None
    # The lease term of the scheduler that dispatched it (shared/lease.py): a worker drops a
    # dispatch whose term is below one it has already seen (a deposed scheduler woke up and sent
    # it). None: not dispatched yet, or by a scheduler older than HA pairs.
    scheduler_term: int | None = None
    # Set by a gateway that dispatched this RT request itself, within the scheduler's grant
    # (shared/schemas/grants.py): the worker it sent it to. The same record goes to that worker's
    # dispatch topic and to `requests.rt`, where the scheduler records it as its own placement
    # instead of placing it again.
    granted_worker: str | None = None

    def resumed(self, token_ids: list[int]) -> GenerateRequest:
        return self.model_copy(update={"attempt": self.attempt + 1, "resume_token_ids": list(token_ids)})
