"""Per-interval SLO and load figures a worker publishes (`Telemetry`).

Load and KV use come from the engine's published snapshot (`AsyncLLM.snapshot()`), never from
its live queues: the snapshot is immutable, so a report cannot meet a list changing under it.
"""

from __future__ import annotations

import time
from collections import deque

from engine.cost_model import CostModel
from engine.outputs import RequestMetrics
from engine.scheduling import SLO, RequestClass
from engine.snapshot import EngineInfo, EngineSnapshot
from shared.schemas.telemetry import ClassLoad, RequestTiming, StepCost, Telemetry

_WINDOW_S = 30.0  # percentiles cover requests finished in this window


def request_timing(request_id: str, req_class: RequestClass, slo: SLO, m: RequestMetrics) -> RequestTiming:
    ttft = m.ttft
    tpot = None
    if m.finish_time is not None and m.first_token_time is not None and m.num_output_tokens > 1:
        tpot = (m.finish_time - m.first_token_time) / (m.num_output_tokens - 1)
    return RequestTiming(
        request_id=request_id,
        req_class=req_class.value,
        ttft_s=ttft,
        tpot_s=tpot,
        output_tokens=m.num_output_tokens,
        met_slo=_met(slo, ttft, tpot),
    )


def _met(slo: SLO, ttft: float | None, tpot: float | None) -> bool | None:
    if slo.ttft_s is None and slo.tpot_s is None:
        return None
    ok_ttft = slo.ttft_s is None or (ttft is not None and ttft <= slo.ttft_s)
    ok_tpot = slo.tpot_s is None or tpot is None or tpot <= slo.tpot_s
    return ok_ttft and ok_tpot


class TelemetryWindow:
    def __init__(self) -> None:
        self._recent: deque[tuple[float, RequestTiming]] = deque()
        self._since_report: list[RequestTiming] = []
        self._tokens = 0
        self._last_report = time.monotonic()

    def add_tokens(self, n: int) -> None:
        self._tokens += n

    def finished(self, timing: RequestTiming) -> None:
        self._recent.append((time.monotonic(), timing))
        self._since_report.append(timing)

    def report(
        self,
        worker_id: str,
        info: EngineInfo,
        snapshot: EngineSnapshot,
        max_num_seqs: int,
        max_num_batched_tokens: int = 0,
    ) -> Telemetry:
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - _WINDOW_S:
            self._recent.popleft()
        timings = [t for _, t in self._recent]
        ttfts = sorted(t.ttft_s for t in timings if t.ttft_s is not None)
        tpots = sorted(t.tpot_s for t in timings if t.tpot_s is not None)
        slo = [t.met_slo for t in timings if t.met_slo is not None]
        msg = Telemetry(
            worker_id=worker_id,
            sent_at=time.time(),
            dtype=info.dtype,
            rt=_load(snapshot, RequestClass.RT),
            be=_load(snapshot, RequestClass.BE),
            kv_usage=snapshot.kv_usage,
            kv_blocks=info.kv_blocks,
            max_num_seqs=max_num_seqs,
            tokens_per_s=self._tokens / max(now - self._last_report, 1e-6),
            ttft_p50_s=_pct(ttfts, 0.5),
            ttft_p99_s=_pct(ttfts, 0.99),
            tpot_p50_s=_pct(tpots, 0.5),
            tpot_p99_s=_pct(tpots, 0.99),
            slo_attainment=sum(slo) / len(slo) if slo else None,
            finished=self._since_report,
            cost=step_cost(info.cost_model),
            block_size=info.block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            policy_stats=None if snapshot.policy_stats is None else dict(snapshot.policy_stats),
        )
        self._since_report, self._tokens, self._last_report = [], 0, now
        return msg


def step_cost(cost: CostModel | None) -> StepCost | None:
    """The engine's profile in wire form (None: the engine has none)."""
    if cost is None:
        return None
    return StepCost(
        prefill_alpha0=cost.prefill.alpha0,
        prefill_alpha1=cost.prefill.alpha1,
        prefill_beta=cost.prefill.beta,
        decode_alpha0=cost.decode.alpha0,
        decode_alpha1=cost.decode.alpha1,
        decode_beta=cost.decode.beta,
        swap_bytes_per_s=cost.swap_bytes_per_s,
    )


def _load(snapshot: EngineSnapshot, cls: RequestClass) -> ClassLoad:
    counts = snapshot.counts(cls)  # as of the engine's last step
    return ClassLoad(running=counts.running, waiting=counts.waiting)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]
