"""SLO-aware placement: the predictor's arithmetic and the policy's choices (pure logic)."""

from __future__ import annotations

import pytest

from engine.cost_model import CostModel, PhaseFit
from services.scheduler.placement import LeastLoaded, PlacementRequest, WorkerLoad, make_placement
from services.scheduler.slo_placement import SLOPlacement
from services.scheduler.slo_predict import PredictorSettings, SessionKV, SLOPredictor, SLOTarget

# 1 ms per prefill token + 10 ms per pass; decode 2 ms per row + 10 ms per pass; no attention term
COST = CostModel(PhaseFit(1e-3, 0.0, 0.01), PhaseFit(2e-3, 0.0, 0.01), swap_bytes_per_s=1e9)
SLOW = CostModel(PhaseFit(4e-3, 0.0, 0.04), PhaseFit(8e-3, 0.0, 0.04), swap_bytes_per_s=1e9)


def _w(wid: str, cost=COST, **kw) -> WorkerLoad:
    base = {"max_num_batched_tokens": 1000, "kv_blocks": 1000, "block_size": 16, "mean_context_tokens": 100.0}
    return WorkerLoad(wid, cost=cost, **{**base, **kw})


def _rt(prompt: int = 100, **kw) -> PlacementRequest:
    return PlacementRequest("r", "rt", num_prompt_tokens=prompt, max_tokens=10, **kw)


def test_idle_worker_prediction_is_one_prefill_step_and_a_batch_of_one():
    p = SLOPredictor().predict(_rt(100), _w("a"), None)
    assert p.kv_route == "new" and not p.kv_short
    assert p.ttft_s == pytest.approx(100 * 1e-3 + 0.01)
    assert p.tpot_s == pytest.approx(2e-3 + 0.01)


def test_queue_ahead_and_running_batch_raise_ttft_and_tpot():
    idle = SLOPredictor().predict(_rt(100), _w("a"), None)
    busy = SLOPredictor().predict(_rt(100), _w("a", running_rt=10, waiting_rt=3), None)
    # 3 queued prompts of the same size ahead, each prefill step shared with 10 decode rows
    assert busy.ttft_s == pytest.approx(400 * 1e-3 + 0.01 + 10 * 2e-3)
    assert busy.tpot_s == pytest.approx(14 * 2e-3 + 0.01)
    assert busy.ttft_s > idle.ttft_s and busy.tpot_s > idle.tpot_s


def test_long_queue_is_prefilled_in_chunks_of_the_step_budget():
    p = SLOPredictor().predict(_rt(100), _w("a", waiting_rt=24, max_num_batched_tokens=1000), None)
    assert p.ttft_s == pytest.approx(3 * (1000 * 1e-3 + 0.01))  # 2500 tokens: three chunks of 1000


def test_full_worker_waits_for_a_slot():
    free = SLOPredictor().predict(_rt(), _w("a", running_rt=3, max_num_seqs=4), None)
    full = SLOPredictor().predict(_rt(), _w("a", running_rt=6, max_num_seqs=4), None)
    assert full.ttft_s > free.ttft_s + 2 * 10 / 4 * free.tpot_s * 0.99


def test_kv_short_when_free_blocks_cannot_hold_the_request():
    p = SLOPredictor().predict(_rt(1000), _w("a", kv_usage=0.95, kv_blocks=100), None)  # 80 tokens free
    assert p.kv_short and not p.meets(SLOTarget(10.0, 10.0))


def test_session_kv_route_local_transfer_or_recompute():
    session = SessionKV(history_tokens=900, bytes_per_token=1000.0, holder="h", local_tokens={"h": 900})
    pred = SLOPredictor(PredictorSettings(kv_transfer_bytes_per_s=1e9))
    local = pred.predict(_rt(1000), _w("h"), session)
    assert local.kv_route == "local" and local.ttft_s == pytest.approx(100 * 1e-3 + 0.01)
    moved = pred.predict(_rt(1000), _w("x"), session)
    assert moved.kv_route == "transfer"  # 0.9 ms on the wire beats 0.9 s of prefill
    assert moved.ttft_s == pytest.approx(900 * 1000 / 1e9 + 100 * 1e-3 + 0.01)
    no_link = SLOPredictor().predict(_rt(1000), _w("x"), session)
    assert no_link.kv_route == "recompute" and no_link.ttft_s == pytest.approx(1000 * 1e-3 + 0.01)


def test_unprofiled_worker_gets_no_prediction():
    assert SLOPredictor().predict(_rt(), WorkerLoad("a"), None) is None


def test_policy_picks_the_worker_with_most_slack_not_the_least_loaded():
    # "fast" runs more requests but its profile is 4x quicker: it still has more slack
    workers = [_w("slow", cost=SLOW, running_rt=2), _w("fast", running_rt=6)]
    d = make_placement("slo").decide(_rt(100, slo_ttft_s=0.5, slo_tpot_s=0.1), workers)
    assert d.worker_id == "fast" and d.meets_slo is True
    assert make_placement("least-loaded").place(_rt(100), workers) == "slow"


def test_policy_honours_affinity_only_while_it_meets_the_slo():
    session = SessionKV(history_tokens=900, holder="h", local_tokens={"h": 900})
    workers = [_w("h", running_rt=5), _w("x")]
    req = _rt(1000, slo_ttft_s=0.5, slo_tpot_s=0.1, preferred_worker="h", session_kv=session)
    assert SLOPlacement().decide(req, workers).worker_id == "h"  # local hit: 0.11 s prefill
    swamped = [_w("h", waiting_rt=40), _w("x")]
    assert SLOPlacement().decide(req, swamped).worker_id == "x"  # recompute on x beats the queue on h


def test_no_worker_meets_slo_names_best_with_reason_and_holds_be():
    policy = SLOPlacement()
    workers = [_w("a", waiting_rt=1000), _w("b", waiting_rt=1500)]
    d = policy.decide(_rt(100, slo_ttft_s=0.1, slo_tpot_s=1.0), workers)
    assert d.worker_id == "a" and d.meets_slo is False
    assert "no worker meets the SLO" in d.reason and d.retry_after_s >= 1.0
    assert policy.decide(PlacementRequest("b", "be"), workers).worker_id is None  # BE held back
    assert policy.be_slots(workers) == 0
    ok = policy.decide(_rt(100, slo_ttft_s=1.0, slo_tpot_s=1.0), [_w("c")])
    assert ok.meets_slo is True
    assert policy.decide(PlacementRequest("b", "be"), [_w("c")]).worker_id == "c"  # released


def test_policy_falls_back_to_least_loaded_without_profiles():
    workers = [WorkerLoad("a", running_rt=5), WorkerLoad("b", running_rt=1)]
    d = SLOPlacement().decide(_rt(), workers)
    assert d.worker_id == "b" and d.reason == "no profiles" and d.meets_slo is None


def test_be_held_while_rt_is_over_slo_and_released_by_the_probe_without_another_rt_request():
    crawl = CostModel(PhaseFit(1e-3, 0.0, 5.0), PhaseFit(1e-3, 0.0, 5.0), 1e9)  # 5 s per step: no SLO holds
    slow = [_w("s", cost=crawl)]
    assert LeastLoaded().place(PlacementRequest("b", "be"), slow) == "s"  # least-loaded would add BE
    policy = SLOPlacement()
    assert policy.decide(_rt(100), slow).meets_slo is False
    assert policy.decide(PlacementRequest("b", "be"), slow).worker_id is None  # held back
    assert policy.be_slots(slow) == 0
    fast = [*slow, _w("f")]  # a worker where a typical RT request fits joins; no RT request comes
    assert policy.be_slots(fast) > 0
    assert policy.decide(PlacementRequest("b", "be"), fast).worker_id in {"s", "f"}
