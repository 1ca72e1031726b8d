"""`heartbeats` and `telemetry`: what workers say about themselves.

Heartbeats (every `heartbeat_interval_s`) say a worker is alive, what it serves and which
requests it holds; the scheduler uses the id lists to tell finished requests from lost ones.
Telemetry (every second) carries load and the SLO figures the worker achieved.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from shared.schemas.base import WireModel


class Heartbeat(WireModel):
    worker_id: str
    model: str  # the model id clients name
    max_model_len: int
    dispatch_topic: str
    dtype: str | None = None  # the dtype the engine runs in (dtype "auto" decided at start)
    device: str | None = None
    started_at: float
    sent_at: float
    # The worker process's epoch: its start time in milliseconds, raised past a `Fence` when it
    # rejoins after being declared lost. Requests dispatched to a fenced epoch are not served.
    # Optional in schema 1 (0: a worker older than epochs, fenced like any other).
    epoch: int = 0
    draining: bool = False
    kv_url: str | None = None  # base URL of its KV server (peers pull sessions' KV from it)
    session_stats: dict[str, float] = Field(default_factory=dict)  # kept-KV counters (docs/sessions.md)
    running_ids: list[str] = Field(default_factory=list)  # "request_id:attempt" held by the engine
    finished_ids: list[str] = Field(default_factory=list)  # ... finished in the last minute
    # The next offset its dispatch reader will read (`dispatch_topic`, partition 0), taken with
    # the id lists above: a dispatch below it has been read, and is running, finished or dropped;
    # one at or above it has not been read yet (the scheduler does not call it lost for that:
    # services/scheduler/failures.py). None: not reading yet, or a worker older than the field.
    dispatch_position: int | None = None


class OwnerHeartbeat(WireModel):
    """`owners`: a gateway replica (the owner of the requests it publishes) is alive. Workers
    cancel the requests of an owner they heard and then did not hear for `worker_timeout_s`."""

    owner_id: str  # the `gateway_id` its requests carry
    started_at: float
    sent_at: float


class RequestTiming(BaseModel):
    """One finished request as the worker saw it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    request_id: str
    req_class: str
    ttft_s: float | None
    tpot_s: float | None
    output_tokens: int
    met_slo: bool | None = None  # None when the request had no SLO


class ClassLoad(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    running: int = 0
    waiting: int = 0


class StepCost(BaseModel):
    """A worker's step-time profile (`engine/cost_model.py`, BROS §4.1), as it travels.

    Per phase: seconds per new token (`alpha0`), per (new token x context token) pair
    (`alpha1`) and per forward pass (`beta`). The scheduler's SLO placement predicts TTFT and
    TPOT on this worker from it (`services/scheduler/slo_predict.py`).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    prefill_alpha0: float
    prefill_alpha1: float
    prefill_beta: float
    decode_alpha0: float
    decode_alpha1: float
    decode_beta: float
    swap_bytes_per_s: float = 0.0


class Telemetry(WireModel):
    worker_id: str
    sent_at: float
    dtype: str | None = None  # the engine's decided dtype, as in the heartbeat
    rt: ClassLoad = ClassLoad()
    be: ClassLoad = ClassLoad()
    kv_usage: float = 0.0  # fraction of KV blocks in use
    kv_blocks: int = 0
    max_num_seqs: int = 0
    tokens_per_s: float = 0.0  # generated tokens, last interval
    ttft_p50_s: float | None = None  # over requests finished in the recent window
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p99_s: float | None = None
    slo_attainment: float | None = None
    finished: list[RequestTiming] = Field(default_factory=list)  # since the last report
    # Added in schema 1 as optional fields (base.py's rule), for the SLO placement: the worker's
    # profile (None: it has none; the scheduler then ranks it by load) and its KV geometry.
    cost: StepCost | None = None
    block_size: int = 0
    max_num_batched_tokens: int = 0
    # Added in schema 1 as optional: the engine policy's own figures as of its last snapshot
    # (`SchedulingPolicy.published_stats`; for ellm its `DecisionStats`: mean ratio, host-step
    # share, decision time p50/p99 wall and CPU, ...); None where the policy keeps none.
    policy_stats: dict[str, float] | None = None
