"""The cluster simulator running the scheduler's SLO placement against least-loaded
(`tandem bench placement`), on a small heterogeneous cluster: same arrivals for both."""

from __future__ import annotations

import argparse

import pytest

from loadgen.bench.placement import mixed_workload, run_one, slowed
from loadgen.factory import load_cost_model


def _args(**kw) -> argparse.Namespace:
    base = {
        "workers": 4,
        "slow_share": 0.5,
        "slow_factor": 3.0,
        "profile": "opt-13b-a100-40gb",
        "rt_rate": 3.0,
        "session_rate": 0.3,
        "be_batch": 8,
        "duration": 15.0,
        "kv_bandwidth_gbps": 10.0,
        "slo_ttft": None,
        "slo_tpot": None,
    }
    return argparse.Namespace(**{**base, **kw})


def test_slo_placement_beats_least_loaded_on_a_mixed_heterogeneous_cluster():
    args = _args()
    base, slo = run_one(args, "least-loaded", 0), run_one(args, "slo", 0)
    assert base["rt_requests"] == slo["rt_requests"] > 0  # the same arrivals
    assert set(base["decisions"]) == {"rt:unpredicted", "be:unpredicted"}  # least-loaded predicts nothing
    assert slo["decisions"].get("rt:meets_slo", 0) > 0
    assert slo["rt_slo_attainment"] > base["rt_slo_attainment"]
    assert slo["rt_ttft_p99_s"] < base["rt_ttft_p99_s"]


def test_mixed_workload_has_single_turn_rt_sessions_and_a_be_backlog():
    w = mixed_workload(_args(), seed=0, max_len=2048)
    kinds = {type(s).__name__ for s in w.sources}
    assert w.open_loop and "BEBacklog" in kinds and "Session" in kinds


def test_slowed_profile_scales_every_step():
    cost = load_cost_model("opt-13b-a100-40gb")
    assert slowed(cost, 2.0).estimate([(100, 100)], [(1, 500)] * 8) == pytest.approx(
        2 * cost.estimate([(100, 100)], [(1, 500)] * 8)
    )
    assert slowed(cost, 1.0) is cost
