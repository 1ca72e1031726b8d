"""Placement policies: which worker runs a request.

Pure functions of a request and the workers' current load, so the scheduler service and the
cluster simulator (`loadgen.sim`) run the same code. `None` means "hold it for now" (no worker,
or for BE: no worker with RT headroom).

`least-loaded` (default):
- RT goes to the live worker with the lowest RT load score. A `preferred_worker` (the worker
  that holds the session's KV) is worth a bounded amount of load, not a blank cheque: it takes
  the turn while its score is within `PlacementLimits.holder_slack` of the least-loaded
  worker's (and below 1.0), else the turn moves and its history is pulled or recomputed there.
  Why bounded: "preferred while it has room" made the policy sticky until the holder was full
  (issue 20), so a least-loaded claim measured a sticky router. Why 4 requests' worth by
  default: on the Llama-3-8B/H100 profile (`loadgen/sim/profiles/`) a ShareGPT turn's mean
  history (~1.4K tokens) prefills in ~50 ms, and four more ~1K-context sequences in the
  holder's batch add ~0.2 ms to each decode step (the profile's per-sequence and
  per-context-token terms), ~50 ms over a ~235-token answer; past that, moving is cheaper.
  SGLang's cache-aware router makes the same trade with a load-imbalance threshold. The
  cluster simulator names the worker that served the session's last turn. The scheduler
  service names none: it routes a session's turn with its affinity policy first
  (`affinity.py`: the advisory placement or the KV holder) and asks placement only for the
  turns affinity leaves open.
- BE goes only where RT has headroom: no RT waiting, KV below the high-water mark, and fewer BE
  requests in flight than the per-worker BE cap, and among those to the one with the fewest BE.

`slo` (`slo_placement.py`): predicts each worker's TTFT/TPOT for the request from its own
profile and places where the SLO holds best (docs/services.md, "Placement by SLO").

Every policy answers `decide()` with a `PlacementDecision` (the worker, whether the SLO is
predicted to hold, and why), so the scheduler can count, log and act on the reason; `place()`
is its worker id.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from engine.cost_model import CostModel


@dataclass(frozen=True)
class PlacementRequest:
    request_id: str
    req_class: str  # "rt" | "be"
    num_prompt_tokens: int = 0  # 0 when unknown (the worker tokenizes)
    session_id: str | None = None
    preferred_worker: str | None = None  # honoured while it has room (least-loaded) or meets the SLO (slo)
    # for the SLO policy: targets (None: the policy's defaults), expected output, the session's KV
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    max_tokens: int | None = None
    session_kv: object | None = None  # slo_predict.SessionKV; None: no session or no copy known


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    running_rt: int = 0
    waiting_rt: int = 0
    running_be: int = 0
    waiting_be: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    max_num_seqs: int = 128
    draining: bool = False
    # what the SLO policy predicts from (telemetry); the defaults mean "not published"
    cost: CostModel | None = None
    kv_blocks: int = 0
    block_size: int = 16
    max_num_batched_tokens: int = 0
    mean_context_tokens: float | None = None
    queued_prefill_tokens: int | None = None

    @property
    def rt(self) -> int:
        return self.running_rt + self.waiting_rt

    @property
    def be(self) -> int:
        return self.running_be + self.waiting_be


@dataclass(frozen=True)
class PlacementLimits:
    kv_high_water: float = 0.9  # above this a worker takes no BE
    be_per_worker: int = 32  # BE requests in flight per worker, at most
    rt_headroom: float = 0.75  # RT load (share of max_num_seqs) above which a worker takes no BE
    # how much more loaded (in requests) the KV holder may be than the least-loaded worker and
    # still take its session's turn (least-loaded; see the module docstring for the 4)
    holder_slack: float = 4.0


@dataclass(frozen=True)
class PlacementDecision:
    """One placement: the worker (None: hold the request), whether its SLO is predicted to hold
    there (None: the policy does not predict), why, and for an RT request no worker can serve in
    time, when to retry."""

    worker_id: str | None
    reason: str
    meets_slo: bool | None = None
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    retry_after_s: float | None = None


class PlacementPolicy(ABC):
    name: ClassVar[str]

    def __init__(self, limits: PlacementLimits = PlacementLimits()) -> None:
        self.limits = limits

    @abstractmethod
    def place(self, request: PlacementRequest, workers: Sequence[WorkerLoad]) -> str | None:
        """The worker id to run `request` on, or None to hold it."""

    def decide(self, request: PlacementRequest, workers: Sequence[WorkerLoad]) -> PlacementDecision:
        """`place` with its reason; policies that predict override it."""
        wid = self.place(request, workers)
        return PlacementDecision(wid, self.name if wid else "no worker with room")

    def be_slots(self, workers: Sequence[WorkerLoad]) -> int:
        """BE requests these workers can hold at once right now (the queue service's release budget)."""
        return 0


class LeastLoaded(PlacementPolicy):
    name = "least-loaded"

    def place(self, request: PlacementRequest, workers: Sequence[WorkerLoad]) -> str | None:
        live = [w for w in workers if not w.draining]
        if request.req_class == "be":
            return self._place_be(live)
        return self._place_rt(request, live)

    def _place_rt(self, request: PlacementRequest, live: Sequence[WorkerLoad]) -> str | None:
        if not live:
            return None
        best = min(live, key=lambda w: (self._rt_score(w), w.worker_id))
        preferred = next((w for w in live if w.worker_id == request.preferred_worker), None)
        if preferred is not None and self._holder_keeps(preferred, best):
            return preferred.worker_id
        return best.worker_id

    def _holder_keeps(self, holder: WorkerLoad, best: WorkerLoad) -> bool:
        return rt_load_score(holder) < 1.0 and within_holder_slack(holder, best, self.limits.holder_slack)

    def _place_be(self, live: Sequence[WorkerLoad]) -> str | None:
        ok = [w for w in live if self._has_rt_headroom(w) and w.be < self.limits.be_per_worker]
        if not ok:
            return None
        return min(ok, key=lambda w: (w.be, w.kv_usage, w.worker_id)).worker_id

    def be_slots(self, workers: Sequence[WorkerLoad]) -> int:
        live = [w for w in workers if not w.draining]
        return sum(self.limits.be_per_worker for w in live if self._has_rt_headroom(w))

    def _rt_score(self, w: WorkerLoad) -> float:
        return rt_load_score(w)

    def _has_rt_headroom(self, w: WorkerLoad) -> bool:
        return (
            w.waiting_rt == 0
            and w.kv_usage < self.limits.kv_high_water
            and w.rt < self.limits.rt_headroom * w.max_num_seqs
        )


def rt_load_score(w: WorkerLoad) -> float:
    """A worker's RT load: requests in flight per sequence slot plus half its KV use. BE counts
    a quarter: it shares the step, but the worker's policy can put RT first."""
    return (w.rt + 0.25 * w.be) / max(1, w.max_num_seqs) + 0.5 * w.kv_usage


def within_holder_slack(holder: WorkerLoad, least: WorkerLoad, slack_requests: float) -> bool:
    """Whether the session's KV holder is at most `slack_requests` requests' worth of load above
    the least-loaded worker: the bounded value of a session's KV location (module docstring).
    Shared by `LeastLoaded` and the scheduler's advisory affinity, so neither is silently sticky."""
    return rt_load_score(holder) - rt_load_score(least) <= slack_requests / max(1, holder.max_num_seqs)


def _placements() -> dict[str, Callable[..., PlacementPolicy]]:
    from services.scheduler.slo_placement import SLOPlacement  # it builds on this module

    return {p.name: p for p in (LeastLoaded, SLOPlacement)}


def make_placement(name: str, limits: PlacementLimits = PlacementLimits(), **options) -> PlacementPolicy:
    """A policy by name; `options` go to policies that take them (the SLO policy's predictor)."""
    policies = _placements()
    if name not in policies:
        raise ValueError(f"unknown placement policy {name!r}; available: {sorted(policies)}")
    return policies[name](limits, **options) if options else policies[name](limits)
