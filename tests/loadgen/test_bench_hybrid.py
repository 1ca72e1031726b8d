"""`tandem bench hybrid` end to end on a tiny MHA model (OPT) with a given profile: every policy
runs on the same arrivals in alternating rounds, the rebuild columns count only rows that
rebuild K/V from stored context (a HIDDEN first prefill has none: the old bench's 0.0), the
summary pairs each seed's runs, and `tandem repro aptserve --engine` runs it as a cell."""

from __future__ import annotations

import json

from engine.cost_model import CostModel, PhaseFit
from loadgen.bench import hybrid, hybrid_summary


def _cost(tmp_path) -> str:
    cost = tmp_path / "cost.json"
    # a cheap rebuild (so aptserve picks HIDDEN under this pool) and a 0.1 ms/token prefill
    CostModel(PhaseFit(1e-4, 1e-8, 1e-3), PhaseFit(1e-4, 1e-8, 1e-3), 1e9, {}, 1e-9).save(cost)
    return str(cost)


def test_hybrid_bench_runs_every_policy_and_splits_hidden_rows(tiny_model_dir, tmp_path):
    out = tmp_path / "hybrid.json"
    argv = [
        *("--model", str(tiny_model_dir("opt")), "--num-blocks", "12", "--max-model-len", "256"),
        *("--rates", "8", "--duration", "1", "--length-scale", "0.1", "--seeds", "1", "--threads", "1"),
        *(
            "--policies",
            "fcfs,aptserve,aptserve-priced,aptserve-paper-hidden",
            "--cost-model",
            _cost(tmp_path),
            "--out",
            str(out),
        ),
    ]
    assert hybrid.main(argv) == 0
    doc = json.loads(out.read_text())
    runs = {r["policy"]: r for r in doc["runs"]}
    assert set(runs) == {"fcfs", "aptserve", "aptserve-priced", "aptserve-paper-hidden"}
    assert len({r["requests"] for r in runs.values()}) == 1  # the same arrivals
    assert (
        runs["aptserve"]["withhold_dropped_hidden"]
        and runs["aptserve-paper-hidden"]["withhold_dropped_hidden"] is False
    )
    assert runs["fcfs"]["hidden_rows"] == 0 and runs["fcfs"]["mean_rebuild_s_per_hidden_step"] is None
    for r in runs.values():
        assert r["hidden_rebuild_rows"] <= r["hidden_rows"] <= r["row_count"]
        assert (r["mean_rebuild_s_per_hidden_step"] is None) == (r["steps_rebuilding"] == 0)
        assert len(r["load_average_before"]) == len(r["load_average_after"]) == 3
        assert r["goodput_rps"] == r["slo_attainment"] * r["requests"] / 1.0
    assert doc["profile"]["per_token_s"] == 1e-9 and doc["provenance"]["git"]
    # which profile each run planned from: the given one, whose file has no record of its load
    assert doc["profile"]["record"]["status"] == "given" and doc["profile"]["record"]["trusted"] is False
    assert all(r["profile"]["status"] == "given" and r["profile"]["key"] == "cost" for r in runs.values())
    assert doc["command"].startswith("tandem bench hybrid")
    per_rate = doc["summary"]["per_rate"]["8.0"]
    assert per_rate["aptserve"]["slo_attainment"]["n"] == 1 and "ratio_to_fcfs" in per_rate["aptserve"]


def test_rounds_alternate_the_order_over_seeds_and_rates():
    order = hybrid_summary.rounds(["fcfs", "aptserve"], [1.0, 2.0], [0, 1])
    assert order == [
        (1.0, 0, "fcfs"),
        (1.0, 0, "aptserve"),
        (1.0, 1, "aptserve"),
        (1.0, 1, "fcfs"),
        (2.0, 0, "fcfs"),
        (2.0, 0, "aptserve"),
        (2.0, 1, "aptserve"),
        (2.0, 1, "fcfs"),
    ]


def _row(policy, rate, seed, att, batch=2.0):
    return {
        "policy": policy,
        "rate": rate,
        "seed": seed,
        "slo_attainment": att,
        "goodput_rps": att * rate,
        "mean_decode_batch": batch,
    }


def test_summary_pairs_seeds_and_reads_the_highest_tested_rate_per_level():
    runs = [
        _row("fcfs", 1.0, 0, 0.95),
        _row("aptserve", 1.0, 0, 0.95),
        _row("fcfs", 2.0, 0, 0.5),
        _row("aptserve", 2.0, 0, 0.92, batch=4.0),
        _row("fcfs", 1.0, 1, 0.8),
        _row("aptserve", 1.0, 1, 0.96),
        _row("fcfs", 2.0, 1, 0.4),
        _row("aptserve", 2.0, 1, 0.6),
    ]
    summary = hybrid_summary.summarize_runs(runs, ["fcfs", "aptserve"])
    ratio = summary["per_rate"]["2.0"]["aptserve"]["ratio_to_fcfs"]
    assert abs(ratio["slo_attainment"]["min"] - 0.6 / 0.4) < 1e-12
    assert abs(ratio["slo_attainment"]["max"] - 0.92 / 0.5) < 1e-12
    assert ratio["mean_decode_batch"]["max"] == 2.0
    eff = summary["effective_rate_tested"]
    assert eff["0.9"] == {"fcfs": {"0": 1.0, "1": None}, "aptserve": {"0": 2.0, "1": 1.0}}
    assert eff["0.6"]["aptserve"] == {"0": 2.0, "1": 2.0}


def test_repro_aptserve_engine_cells_run_the_hybrid_bench(tiny_model_dir, tmp_path, monkeypatch):
    """`tandem repro aptserve --engine`: the engine cells are `tandem bench hybrid` cells, and
    one runs through the repro into a cell JSON and a README table (a tiny model, a given
    profile, one short seed)."""
    from loadgen.repro.registry import REPROS
    from loadgen.repro.run import run_repro

    repro = REPROS["aptserve"]
    cells = [c for c in repro.cells(quick=True, engine=True) if c.name.startswith("engine-")]
    assert cells and all(c.bench == "hybrid" and c.engine and c.policies == ("fcfs", "aptserve") for c in cells)
    assert not [c for c in repro.cells(quick=True, engine=False) if c.name.startswith("engine-")]
    from dataclasses import replace

    small = replace(
        cells[0],
        argv=(
            *("--model", str(tiny_model_dir("opt")), "--num-blocks", "12", "--max-model-len", "256"),
            *("--rates", "8", "--duration", "1", "--length-scale", "0.1", "--seeds", "1"),
            *("--cost-model", _cost(tmp_path)),
        ),
    )
    monkeypatch.setattr(repro, "cells", lambda quick, engine: [small])
    outcome = run_repro(repro, tmp_path, quick=True, engine=True)
    doc = json.loads((tmp_path / f"{small.name}.json").read_text())
    assert {r["policy"] for r in doc["runs"]} == {"fcfs", "aptserve"} and doc["provenance"]["git"]
    assert any(line.startswith(f"| {small.name} | 8.0 |") for line in outcome.readme)
