"""The one rounds runner (`loadgen/bench/rounds.py`) behind `tandem bench policies --rounds N`
(tested in test_loadgen_cli.py) and `tandem bench ellm`: its two orders, what it records per
run, and `tandem bench ellm`'s document through it."""

from __future__ import annotations

import json

import pytest

from loadgen.bench.rounds import round_order, run_rounds


def test_round_orders():
    p = ["fcfs", "swap", "ellm"]
    assert [round_order(p, i, "rotate") for i in range(4)] == [
        ["fcfs", "swap", "ellm"],
        ["swap", "ellm", "fcfs"],
        ["ellm", "fcfs", "swap"],
        ["fcfs", "swap", "ellm"],
    ]
    assert [round_order(p, i, "reverse") for i in range(3)] == [p, p[::-1], p]
    assert [round_order(p[:2], i, "rotate") for i in range(2)] == [round_order(p[:2], i, "reverse") for i in range(2)]
    with pytest.raises(ValueError, match="rotate, reverse"):
        round_order(p, 0, "shuffle")


def test_run_rounds_runs_each_policy_once_per_round_in_order_and_records_it():
    calls, seen = [], []

    def run(policy: str) -> dict:
        calls.append(policy)
        return {"ran": policy, "n": len(calls)}

    rounds = run_rounds(["a", "b", "c"], 2, run, "rotate", seen.append)
    assert calls == ["a", "b", "c", "b", "c", "a"]
    assert [[r.policy for r in rd] for rd in rounds] == [["a", "b", "c"], ["b", "c", "a"]]
    assert seen == [r for rd in rounds for r in rd]  # progress saw every run as it ended
    for i, rd in enumerate(rounds):
        for run_ in rd:
            assert run_.round == i and run_.result["ran"] == run_.policy
            assert len(run_.load_before) == len(run_.load_after) == 3 and run_.wall_s >= 0


@pytest.mark.timeout(300)
def test_bench_ellm_rounds_document(tmp_path):
    """`tandem bench ellm` on the simulator, two rounds: the order rotates, every run carries
    its load average and round, and the ratios are to the first policy of the same round."""
    from services.cli import build_parser

    path = tmp_path / "e.json"
    args = build_parser().parse_args(
        ["bench", "ellm", "--target", "sim", "--policies", "fcfs,ellm", "--rounds", "2", "--duration", "3"]
        + ["--slo-scale", "1", "--rate", "2", "--json", str(path)]
    )
    assert args.func(args) == 0
    doc = json.loads(path.read_text())
    assert set(doc) == {"command", "config", "rounds", "ratios_vs_first_per_round", "ratio_medians", "provenance"}
    assert [[r["policy"] for r in rd] for rd in doc["rounds"]] == [["fcfs", "ellm"], ["ellm", "fcfs"]]
    for i, rd in enumerate(doc["rounds"]):
        for run in rd:
            assert list(run)[:4] == ["policy", "load_before", "load_after", "elapsed_s"] and run["round"] == i
            assert len(run["load_before"]) == 3 and run["rt"]["requests"] > 0
    assert doc["ratios_vs_first_per_round"]["fcfs"]["output_tokens_per_s"] == [1.0, 1.0]
    assert doc["provenance"]["git"]["commit"]
