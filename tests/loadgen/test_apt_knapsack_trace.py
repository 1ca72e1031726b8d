"""`loadgen.sim.apt_knapsack_trace`: the recorder reads aptserve's knapsack inputs without
changing a decision, and its counts agree with the policy's own."""

from __future__ import annotations

from loadgen.sim.apt_knapsack_trace import run

PROFILE = "opt-13b-a100-40gb"


def _check(doc: dict) -> dict:
    kinds = doc["knapsack"]
    assert sum(k["hidden_chosen"] for k in kinds.values()) == doc["hidden_chosen"]
    for k in kinds.values():
        assert k["iterations"] > 0 and k["candidates"] >= k["demoted"] + k["live_multi_block"]
        # a smaller N (the demoted left out) can only put more HIDDEN options on the hull
        assert k["hidden_on_hull_paper_n"] >= k["hidden_on_hull"]
        assert k["memory_binds"] <= k["iterations"]
        # the policy's N is the recorder's (ours): what it chose in HIDDEN was on the hull
        assert k["hidden_chosen"] <= k["hidden_on_hull"]
    return kinds


def test_the_recorder_at_the_papers_values_and_where_hidden_is_free():
    """At the measured ρ almost nothing is on the hull; at ρ ≈ 0 with the paper's rule the
    knapsack takes HIDDEN, and the recorder sees it as on the hull and chosen. The recorder
    changes nothing: the same run recorded twice gives the same attainment."""
    paper = run("aptserve", 8.0, 0, 60, PROFILE, 256)
    kinds = _check(paper)
    assert paper["rho_s_per_block"] > 0
    assert sum(k["iterations"] for k in kinds.values()) > 0
    free = run("aptserve-paper-hidden", 16.0, 0, 160, PROFILE, 256, rho=1e-12)  # the pool binds
    kinds = _check(free)
    assert free["hidden_chosen"] > 0 and sum(k["hidden_on_hull"] for k in kinds.values()) > 0
    assert run("aptserve", 8.0, 0, 60, PROFILE, 256)["slo_attainment"] == paper["slo_attainment"]
