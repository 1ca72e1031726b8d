"""The simulator is fair (issue 20): binary memory sizes, policies plan with a fitted model
(not the function that sets step times), steps carry noise, every policy gets the same host
swap space, and several seeds report their spread."""

from __future__ import annotations

import argparse
import math

import pytest

from engine.cost_model import CostModel, PhaseFit
from loadgen.cli import add_run_args
from loadgen.factory import load_cost_model
from loadgen.orchestrate import _install_policy, _SloScale, _target, run_policies
from loadgen.sim import roofline
from loadgen.sim.jitter import StepJitter
from loadgen.sim.planning import planning_model
from loadgen.spread import seed_spread, stats
from loadgen.workloads.build import WorkloadConfig

COST = CostModel(PhaseFit(2e-4, 1e-8, 0.01), PhaseFit(1e-4, 5e-7, 0.02), 25e9, {"model": "test"})


def _args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_run_args(p, target_default="sim")
    return p.parse_args(["--no-progress", *extra])


def test_gpu_memory_is_binary_and_shipped_profile_matches():
    a100 = roofline.GPUS["a100-40gb"]
    assert a100.memory_bytes == 40 * 2**30
    m = roofline.MODELS["opt-13b"]
    want = int((40 * 2**30 * 0.9 - m.weight_bytes - 2 * 2**30) // m.kv_bytes_per_token)
    assert roofline.kv_capacity_tokens(m, a100, roofline.Efficiency()) == want
    # the shipped file was regenerated: 40e9 bytes gave 10,131 tokens, 24% fewer
    assert load_cost_model("opt-13b-a100-40gb").meta["kv_capacity_tokens"] == want
    assert want > 13000


def test_lognormal_noise_has_the_asked_spread_and_round_trips(tmp_path):
    j = StepJitter.lognormal(0.1, n=8000, seed=1)
    d = j.describe()
    assert abs(d["mean"] - 1.0) < 0.01 and abs(d["cv"] - 0.1) < 0.01
    j.save(tmp_path / "j.json")
    assert StepJitter.load(tmp_path / "j.json") == j
    assert StepJitter.parse("none") is None
    with pytest.raises(ValueError):
        StepJitter.lognormal(-0.1)


def _plan(noise):
    return planning_model(
        COST, noise, seed=0, max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=2048, capacity_tokens=20000
    )


def test_planning_model_is_a_noisy_fit_not_the_truth():
    exact = _plan(None)  # a linear truth, profiled without noise, is recovered
    for got, true in ((exact.prefill, COST.prefill), (exact.decode, COST.decode)):
        assert math.isclose(got.alpha0, true.alpha0, rel_tol=1e-6) and math.isclose(got.beta, true.beta, rel_tol=1e-6)
    noisy = _plan(StepJitter.lognormal(0.1, seed=0))
    assert noisy != COST  # the policy cannot know each step's duration exactly
    # but it is a fair profile: within a few percent of the truth on the grid, on average
    assert abs(noisy.meta["prefill_vs_truth"]) < 0.1 and abs(noisy.meta["decode_vs_truth"]) < 0.1
    assert noisy.meta["prefill_vs_truth"] != 0.0


def test_planning_model_keeps_a_noisy_hidden_rebuild_price():
    """aptserve plans with ρ: a truth that prices HIDDEN rows gives a planning model that does
    too, measured with the profile's noise (and none where the truth has none)."""
    from dataclasses import replace

    assert _plan(None).hidden_s_per_token is None
    truth = replace(COST, hidden_s_per_token=2.7e-5)
    plan = planning_model(
        truth,
        StepJitter.lognormal(0.1, seed=0),
        seed=0,
        max_num_batched_tokens=2048,
        max_num_seqs=128,
        max_model_len=2048,
        capacity_tokens=20000,
    )
    assert plan.hidden_s_per_token is not None and plan.hidden_s_per_token != 2.7e-5
    assert abs(plan.hidden_s_per_token / 2.7e-5 - 1) < 0.5


def test_policies_plan_with_the_fitted_model_and_share_host_space():
    args = _args("--workload", "rt-be", "--duration", "5")
    hosts = set()
    for policy in ("fcfs", "fcfs-prefill-first", "swap", "bros"):
        scale = _SloScale(args)
        bundle = _target(args, policy, scale)
        _install_policy(bundle, policy, WorkloadConfig("rt-be", None, 5.0))
        target = bundle.target
        w = next(iter(target.workers.values()))
        hosts.add(w.kv.host.num_blocks)
        if policy == "bros":
            assert w.scheduler.policy.cost_model is target.planning_cost
            assert w.scheduler.policy.cost_model != w.cost  # the truth stays the simulator's
        assert w.noise is not None and w.noise.describe()["cv"] > 0.04
    bytes_per_block = 819200 * 16  # OPT-13B fp16, 16-token blocks
    assert hosts == {int(4 * 2**30) // bytes_per_block}  # vLLM's 4 GiB, the same for every policy


@pytest.mark.timeout(300)
def test_seeds_report_their_spread():
    args = _args("--workload", "rt-be", "--duration", "20", "--rate", "1", "--be-batch", "8", "--seeds", "2")
    doc = run_policies(args, ["fcfs", "bros"], comparison=True, progress=False)
    spread = doc["seeds"]
    assert spread["seeds"] == [0, 1] and spread["baseline"] == "fcfs"
    lat = spread["ratios"]["bros"]["rt"]["normalized_latency_s"]
    assert lat["n"] == 2 and lat["min"] <= lat["mean"] <= lat["max"]
    assert len(set(spread["metrics"]["fcfs"]["rt"]["ttft_p50_s"]["values"])) == 2  # two different arrival draws
    # the first seed's values are the document's own summary
    assert spread["metrics"]["fcfs"]["rt"]["ttft_p50_s"]["values"][0] == doc["summary"]["fcfs"]["rt"]["ttft_p50_s"]
    # every seed's requests as one sample (session 12: a p99 over all of them, not a mean of maxima):
    # more requests than the first seed's, and a percentile of the mixture lies within the seeds'
    pooled = spread["pooled"]["fcfs"]["rt"]
    assert pooled["requests"] > doc["summary"]["fcfs"]["rt"]["requests"]
    p99s = spread["metrics"]["fcfs"]["rt"]["ttft_p99_s"]["values"]
    assert min(p99s) * 0.999 <= pooled["ttft_p99_s"] <= max(p99s) * 1.001


def test_spread_stats():
    s = stats([1.0, None, 3.0])
    assert s == {"mean": 2.0, "min": 1.0, "max": 3.0, "stdev": math.sqrt(2.0), "n": 2, "values": [1.0, None, 3.0]}
    assert stats([None])["mean"] is None
    summ = lambda v: {c: {"throughput_rps": v} for c in ("rt", "be", "all")}  # noqa: E731
    out = seed_spread([0, 1], {"a": [summ(1.0), summ(2.0)], "b": [summ(2.0), summ(2.0)]})
    assert out["ratios"]["b"]["be"]["throughput_rps"]["values"] == [2.0, 1.0]  # paired per seed
