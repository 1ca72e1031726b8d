"""`slo` placement: put each RT request where its predicted TTFT and TPOT hold best.

For an RT request the policy asks `SLOPredictor` for every live worker that publishes a
profile and then:

1. the caller's `preferred_worker` (the session's affinity: its advisory placement or KV holder)
   when the SLO is predicted to hold there: affinity proposes, the SLO disposes;
2. else, among the workers predicted to meet the SLO, the one with the lowest ratio
   (max of predicted/target over TTFT and TPOT): the most slack, so a burst behind it still fits.
   "Best" is most slack rather than tightest fit: a tight fit packs work onto few workers and
   leaves none of them room for the next long prompt, while spare room on an RT worker costs RT
   nothing (docs/services.md, "Placement by SLO"; tightest fit was not measured);
3. else no worker meets it: the decision names the best worker anyway with `meets_slo=False`,
   a reason, and `retry_after_s` (how much later the best worker is predicted to have room).
   The scheduler admits it there or answers 429 (`TANDEM_SLO_OVERLOAD`), its choice, not ours.

While the last RT decision found no worker meeting its SLO, BE is held back (no BE placed, no
BE slots offered to the queue service): RT is over its targets and BE would only add to the
batch. The first RT request that fits again releases it, and so does a probe: each BE decision
asks whether a typical RT request (the predictor's default sizes, the default SLO) would now
fit on some worker, so BE does not stay held after a burst when no RT request follows. BE
otherwise goes where least-loaded would put it (RT headroom, BE cap per worker).

Workers without a profile cannot be predicted: when none has one, RT falls back to
least-loaded (decision reason `no profiles`); otherwise they are only used when no profiled
worker meets the SLO and least-loaded ranks them first (reason `unpredicted`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from services.scheduler.placement import (
    LeastLoaded,
    PlacementDecision,
    PlacementLimits,
    PlacementPolicy,
    PlacementRequest,
    WorkerLoad,
)
from services.scheduler.slo_predict import Prediction, PredictorSettings, SessionKV, SLOPredictor, SLOTarget


class SLOPlacement(PlacementPolicy):
    name = "slo"

    def __init__(
        self,
        limits: PlacementLimits | None = None,
        predictor: PredictorSettings | None = None,
        default_slo: SLOTarget | None = None,
    ) -> None:
        limits = limits or PlacementLimits()
        super().__init__(limits)
        self.predictor = SLOPredictor(predictor or PredictorSettings())
        self.default_slo = default_slo or SLOTarget(ttft_s=1.0, tpot_s=0.2)
        self.by_load = LeastLoaded(limits)  # BE, and RT when nothing can be predicted
        self.rt_over_slo = False  # the last RT decision found no worker meeting its SLO

    def place(self, request: PlacementRequest, workers: Sequence[WorkerLoad]) -> str | None:
        return self.decide(request, workers).worker_id

    def decide(self, request: PlacementRequest, workers: Sequence[WorkerLoad]) -> PlacementDecision:
        live = [w for w in workers if not w.draining]
        if request.req_class == "be":
            return self._decide_be(request, live)
        return self._decide_rt(request, live)

    def be_slots(self, workers: Sequence[WorkerLoad]) -> int:
        return 0 if self._rt_still_over(workers) else self.by_load.be_slots(workers)

    # -- internals -----------------------------------------------------------------------

    def _decide_be(self, request: PlacementRequest, live: Sequence[WorkerLoad]) -> PlacementDecision:
        if self._rt_still_over(live):
            return PlacementDecision(None, "BE held: RT is over its SLO")
        wid = self.by_load.place(request, live)
        return PlacementDecision(wid, "BE where RT has headroom" if wid else "BE held: no RT headroom")

    def _decide_rt(self, request: PlacementRequest, live: Sequence[WorkerLoad]) -> PlacementDecision:
        if not live:
            return PlacementDecision(None, "no live worker")
        slo = self.target(request)
        session = request.session_kv if isinstance(request.session_kv, SessionKV) else None
        preds = [p for w in live if (p := self.predictor.predict(request, w, session)) is not None]
        if not preds:
            return PlacementDecision(self.by_load.place(request, live), "no profiles")
        preferred = next((p for p in preds if p.worker_id == request.preferred_worker), None)
        if preferred is not None and preferred.meets(slo):
            return self._met(preferred, "affinity, meets SLO")
        meeting = [p for p in preds if p.meets(slo)]
        if meeting:
            return self._met(min(meeting, key=lambda p: (p.ratio(slo), p.worker_id)), "most SLO slack")
        return self._missed(request, live, preds, slo)

    def _met(self, p: Prediction, why: str) -> PlacementDecision:
        self.rt_over_slo = False
        return PlacementDecision(
            p.worker_id,
            f"{why} ({p.kv_route})",
            meets_slo=True,
            predicted_ttft_s=p.ttft_s,
            predicted_tpot_s=p.tpot_s,
        )

    def _missed(
        self, request: PlacementRequest, live: Sequence[WorkerLoad], preds: list[Prediction], slo: SLOTarget
    ) -> PlacementDecision:
        self.rt_over_slo = True
        if len(preds) < len(live):  # an unprofiled worker may do better: least-loaded picks one
            predicted = {p.worker_id for p in preds}
            wid = self.by_load.place(request, [w for w in live if w.worker_id not in predicted])
            return PlacementDecision(wid, "unpredicted: no profiled worker meets the SLO", meets_slo=None)
        best = min(preds, key=lambda p: (p.kv_short, p.ratio(slo), p.worker_id))
        why = "no KV room" if best.kv_short else f"TTFT {best.ttft_s:.3f}s / TPOT {best.tpot_s:.3f}s predicted"
        return PlacementDecision(
            best.worker_id,
            f"no worker meets the SLO (TTFT {slo.ttft_s:g}s, TPOT {slo.tpot_s:g}s); best {best.worker_id}: {why}",
            meets_slo=False,
            predicted_ttft_s=best.ttft_s,
            predicted_tpot_s=best.tpot_s,
            retry_after_s=max(1.0, math.ceil(best.ttft_s - slo.ttft_s)),
        )

    def _rt_still_over(self, workers: Sequence[WorkerLoad]) -> bool:
        """Whether RT is still over its SLO: clears once a typical RT request would fit somewhere."""
        if self.rt_over_slo:
            probe = PlacementRequest("rt-probe", "rt")
            live = [w for w in workers if not w.draining]
            preds = (self.predictor.predict(probe, w, None) for w in live)
            self.rt_over_slo = not any(p is not None and p.meets(self.default_slo) for p in preds)
        return self.rt_over_slo

    def target(self, request: PlacementRequest) -> SLOTarget:
        return SLOTarget(
            ttft_s=request.slo_ttft_s or self.default_slo.ttft_s,
            tpot_s=request.slo_tpot_s or self.default_slo.tpot_s,
        )
