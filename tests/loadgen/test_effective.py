"""Effective-throughput bisection against attainment curves with a known crossing."""

from __future__ import annotations

import pytest

from loadgen.effective import effective_throughput


def step_curve(knee: float):
    return lambda rate: 0.95 if rate <= knee else 0.5


@pytest.mark.parametrize("knee", [0.3, 1.0, 3.7, 11.0])
def test_finds_the_knee_within_tolerance(knee):
    res = effective_throughput(step_curve(knee), 0.9, start=1.0, rel_tol=0.02)
    assert res.rate <= knee
    assert res.rate >= knee * 0.97
    assert res.bracketed
    assert all(a >= 0.9 for r, a in res.probes if r <= knee)


def test_linear_curve_crossing():
    res = effective_throughput(lambda r: 1.0 - 0.1 * r, 0.6, start=1.0, rel_tol=0.01)
    assert res.rate == pytest.approx(4.0, rel=0.02)


def test_never_met_gives_zero_and_always_met_is_unbracketed():
    assert effective_throughput(lambda r: 0.0, 0.9, start=1.0).rate == 0.0
    res = effective_throughput(lambda r: 1.0, 0.9, start=1.0, max_rate=16.0)
    assert res.rate == 16.0 and not res.bracketed


def test_bad_target_is_a_value_error():
    with pytest.raises(ValueError):
        effective_throughput(lambda r: 1.0, 1.5)


def _rec(arrival, tokens=(), finish=None, ttft=1.0, tpot=1.0):
    from loadgen.metrics import RequestRecord

    rec = RequestRecord("r", "rt", arrival, 10, 8, ttft, tpot)
    rec.token_times_s, rec.finish_s = list(tokens), finish
    rec.finish_reason = "length" if finish is not None else None
    return rec


def test_miss_bound_counts_only_certain_misses():
    """Closed misses, open requests past their TTFT with no token, and late first tokens are
    certain; an open request within its TTFT, an open one with a timely token (its P99 TBT is
    not known yet) and a request without an SLO are not."""
    from loadgen.effective import MissBound

    records = [
        _rec(0.0, (0.5, 0.6), finish=0.6),  # met: not a miss
        _rec(0.0, (3.0, 3.1), finish=3.1),  # closed, TTFT 3 s: a miss
        _rec(1.0),  # open, 4 s without a token at now=5: a miss
        _rec(4.5),  # open, within its TTFT: undecided
        _rec(0.0, (2.0,)),  # open, first token 2 s late: a miss
        _rec(0.0, (0.5, 3.0)),  # open, a 2.5 s gap but its P99 TBT is not known yet: undecided
        _rec(0.0, ttft=None, tpot=None),  # no SLO: not counted
    ]
    bound = MissBound(0.5, total=7)
    assert bound(records, 5.0) is False  # 3 certain misses of 7: at most 4/7, not below 0.5
    assert bound.misses == 3 and bound.at_most == 4 / 7
    records.append(_rec(0.0, (0.2, 0.3), finish=5.5, tpot=0.05))  # P99 TBT 100 ms over 50 ms
    assert bound(records, 5.5) is False  # rescans at most once per second of the clock
    # at 6 s: that one, and the request of 4.5 s now past its TTFT: 5 of 7
    assert bound(records, 6.0) is True and bound.misses == 5
    with pytest.raises(ValueError):
        MissBound(0.9, total=0)


@pytest.mark.timeout(300)
def test_an_overloaded_probe_stops_early_and_its_bound_holds():
    """On the simulator: a probe past the wall stops once it cannot reach 90%, earlier than the
    same run served to its end, whose attainment is at most the bound it stopped at; a probe
    that meets the target is never stopped."""
    from loadgen.arrivals import ArrivalSpec
    from loadgen.driver import Driver
    from loadgen.effective import MissBound
    from loadgen.metrics import summarize
    from loadgen.prompts import PromptBuilder
    from loadgen.sim.cluster import ClusterSpec, SimTarget
    from loadgen.sim.worker import SimWorker, WorkerSpec
    from loadgen.workloads.build import WorkloadConfig, build_workload
    from tests.loadgen.test_sim import COST

    def run(rate, stop):
        cfg = WorkloadConfig("sharegpt", ArrivalSpec("poisson", rate), 20.0, seed=2, length_scale=0.5)
        worker = SimWorker(
            "w0", WorkerSpec(num_blocks=96, max_model_len=2048, kv_bytes_per_token=100_000), COST, "fcfs"
        )
        workload = build_workload(cfg)
        total = sum(1 for s in workload.open_loop if s.at_s < cfg.duration_s)
        bound = MissBound(0.9, total) if stop else None
        driver = Driver(SimTarget([worker], ClusterSpec()), workload, PromptBuilder(49152, 2), stop_when=bound)
        return driver.run(), bound

    full, _ = run(8.0, stop=False)
    early, bound = run(8.0, stop=True)
    measured = summarize(full.records, full.elapsed_s)["rt"]["slo_attainment"]
    assert early.stopped_early and not full.stopped_early
    assert early.elapsed_s < full.elapsed_s
    assert measured <= bound.at_most < 0.9
    easy, easy_bound = run(0.5, stop=True)
    assert not easy.stopped_early and summarize(easy.records, easy.elapsed_s)["rt"]["slo_attainment"] >= 0.9


@pytest.mark.timeout(300)
def test_find_rate_decide_early_flags_the_stopped_probes():
    """`tandem sim --find-rate --decide-early --max-rate`: the probes that stopped early are
    flagged as upper bounds, all below the target, and the rate found is one probe that met it
    (never one that stopped); the cap bounds the probed rates."""
    import argparse

    from loadgen.cli import add_run_args
    from loadgen.orchestrate import _search, _SloScale

    p = argparse.ArgumentParser()
    add_run_args(p, target_default="sim")
    args = p.parse_args(
        [
            *("--duration", "10", "--rate", "2", "--length-scale", "0.5", "--seed", "1"),
            *("--slo-ttft", "1", "--slo-tpot", "1", "--num-blocks", "64", "--attainment", "0.9"),
            *("--find-rate", "--decide-early", "--max-rate", "64"),
        ]
    )
    found = _search(args, "fcfs", _SloScale(args)).as_dict()
    early = [pr for pr in found["probes"] if pr.get("attainment_at_most")]
    assert early and all(pr["attainment"] < 0.9 for pr in early)
    assert max(pr["rate"] for pr in found["probes"]) <= 64
    met = {pr["rate"] for pr in found["probes"] if pr["attainment"] >= 0.9 and not pr.get("attainment_at_most")}
    assert found["rate"] in met
