"""What the scheduler service hands its placement policy: requests, worker loads, the policy.

Translation only (wire messages and the scheduler's tables in, `placement.py`'s dataclasses
out), so the policies stay pure and the cluster simulator feeds them the same types.

- The prompt's size is estimated, not tokenized (the worker owns the tokenizer): token ids
  count as they are, text as `characters / chars_per_token` (4 by default, the usual figure for
  English with BPE vocabularies). An over- or under-estimate shifts every worker's predicted
  prefill alike, so the ranking is kept; only the admit/reject edge moves.
- A session's KV comes from the session directory: the newest live copy's tokens and bytes per
  token, and each worker's own copy.
"""

from __future__ import annotations

import time
from collections.abc import Container

from engine.cost_model import CostModel, PhaseFit
from services.scheduler.placement import (
    PlacementDecision,
    PlacementLimits,
    PlacementPolicy,
    PlacementRequest,
    WorkerLoad,
    make_placement,
)
from services.scheduler.registry import WorkerInfo
from services.scheduler.settings import SchedulerSettings
from services.scheduler.slo_predict import PredictorSettings, SessionKV, SLOTarget
from shared.schemas.capacity import BECapacity
from shared.schemas.requests import GenerateRequest
from shared.schemas.results import Failed
from shared.schemas.telemetry import StepCost
from shared.session_state import SessionDirectory


def build_placement(settings: SchedulerSettings) -> PlacementPolicy:
    limits = PlacementLimits(
        kv_high_water=settings.kv_high_water, be_per_worker=settings.be_per_worker, holder_slack=settings.holder_slack
    )
    if settings.placement != "slo":
        return make_placement(settings.placement, limits)
    return make_placement(
        "slo",
        limits,
        predictor=PredictorSettings(kv_transfer_bytes_per_s=settings.kv_transfer_bytes_per_s),
        default_slo=SLOTarget(settings.slo_ttft_s, settings.slo_tpot_s),
    )


def estimate_prompt_tokens(req: GenerateRequest, chars_per_token: float) -> int:
    """Prompt tokens, estimated without a tokenizer (0 when there is nothing to count)."""
    if isinstance(req.prompt, list):
        return len(req.prompt) + len(req.resume_token_ids)
    chars = len(req.prompt or "") + sum(len(m.content) for m in req.messages or ())
    return int(chars / chars_per_token) + len(req.resume_token_ids)


def session_kv(directory: SessionDirectory, session_id: str | None, live: Container[str]) -> SessionKV | None:
    newest = directory.holder(session_id, live)
    if newest is None or newest.num_tokens <= 0:
        return None
    local = {c.worker_id: c.num_tokens for c in directory.copies(session_id) if not c.dropped and c.worker_id in live}
    return SessionKV(
        history_tokens=newest.num_tokens,
        bytes_per_token=newest.nbytes / newest.num_tokens,
        holder=newest.worker_id if newest.kv_url else None,  # no KV server: nobody can pull from it
        local_tokens=local,
    )


def placement_request(
    req: GenerateRequest, settings: SchedulerSettings, session: SessionKV | None, preferred: str | None = None
) -> PlacementRequest:
    return PlacementRequest(
        request_id=req.request_id,
        req_class=req.req_class,
        num_prompt_tokens=estimate_prompt_tokens(req, settings.chars_per_token),
        session_id=req.session_id,
        preferred_worker=preferred,
        slo_ttft_s=req.slo.ttft_ms / 1000 if req.slo.ttft_ms else None,
        slo_tpot_s=req.slo.tpot_ms / 1000 if req.slo.tpot_ms else None,
        max_tokens=req.sampling.max_tokens,
        session_kv=session,
    )


def cost_model(c: StepCost | None) -> CostModel | None:
    if c is None:
        return None
    return CostModel(
        PhaseFit(c.prefill_alpha0, c.prefill_alpha1, c.prefill_beta),
        PhaseFit(c.decode_alpha0, c.decode_alpha1, c.decode_beta),
        c.swap_bytes_per_s,
    )


def worker_load(w: WorkerInfo, counts: dict[tuple[str, str], int]) -> WorkerLoad:
    """A live worker's load: in-flight counts from our assignments, the rest from its telemetry."""
    wid = w.heartbeat.worker_id
    t = w.telemetry
    waiting_rt = t.rt.waiting if t else 0
    waiting_be = t.be.waiting if t else 0
    return WorkerLoad(
        worker_id=wid,
        running_rt=max(0, counts.get((wid, "rt"), 0) - waiting_rt),
        waiting_rt=waiting_rt,
        running_be=max(0, counts.get((wid, "be"), 0) - waiting_be),
        waiting_be=waiting_be,
        kv_usage=t.kv_usage if t else 0.0,
        max_num_seqs=t.max_num_seqs if t and t.max_num_seqs else 128,
        draining=w.heartbeat.draining,
        cost=cost_model(t.cost) if t else None,
        kv_blocks=t.kv_blocks if t else 0,
        block_size=t.block_size if t and t.block_size else 16,
        max_num_batched_tokens=t.max_num_batched_tokens if t else 0,
    )


def be_capacity(
    source: str,
    placement: PlacementPolicy,
    loads: dict[str, list[WorkerLoad]],
    counts: dict[tuple[str, str], int],
    pending: int,
) -> BECapacity:
    """`be.capacity`'s record: the BE slots per model (`loads`: model -> its live workers' loads)."""
    by_model = {m: placement.be_slots(w) for m, w in loads.items()}
    return BECapacity(
        source=source,
        sent_at=time.time(),
        slots=sum(by_model.values()),
        in_flight=sum(n for (_, cls), n in counts.items() if cls == "be"),
        pending=pending,
        by_model=by_model,
    )


def rejection(req: GenerateRequest, d: PlacementDecision) -> Failed:
    """The 429 an RT request gets when no worker is predicted to meet its SLO (`slo_overload=reject`)."""
    return Failed(
        request_id=req.request_id,
        attempt=req.attempt,
        status=429,
        code="slo_unattainable",
        message=f"no worker can meet this request's latency target now: {d.reason}",
        retry_after_s=d.retry_after_s,
    )
