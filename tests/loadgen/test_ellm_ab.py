"""`python -m loadgen.bench.ellm_ab`'s ratios are taken within a round (a busy machine moves the
absolute figures between rounds, not the ratio of runs made next to each other)."""

from __future__ import annotations

import pytest

from loadgen.bench.ellm_ab import METRICS, ratios


def _run(policy: str, tokens: float) -> dict:
    return {"policy": policy, "rt": dict.fromkeys(METRICS, tokens)}


def test_ratios_are_per_round_against_the_same_rounds_baseline():
    rounds = [[_run("fcfs", 10.0), _run("ellm", 20.0)], [_run("ellm", 3.0), _run("fcfs", 2.0)]]
    table = ratios(rounds, "fcfs")
    assert table["ellm"]["output_tokens_per_s"] == pytest.approx([2.0, 1.5])
    assert table["fcfs"]["completed"] == pytest.approx([1.0, 1.0])


def test_a_missing_figure_gives_no_ratio():
    rounds = [[_run("fcfs", 10.0), {"policy": "ellm", "rt": dict.fromkeys(METRICS, None)}]]
    assert ratios(rounds, "fcfs")["ellm"]["ttft_p50_s"] == [None]
