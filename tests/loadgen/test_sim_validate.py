"""`python -m loadgen.sim.validate` end to end on a tiny model (a real engine run, then the
simulator with a cost model fitted to that run's steps)."""

from __future__ import annotations

import json

import pytest

from loadgen.sim.validate import METRICS, main


@pytest.mark.timeout(300)
def test_same_run_calibration_with_jitter(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "validation.json"
    assert (
        main(
            [
                "--model",
                str(tiny_model_dir("llama")),
                "--dtype",
                "float32",
                "--rates",
                "2",
                "--duration",
                "6",
                "--calibration",
                "same-run",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert doc["cost_model"] is None and run["jitter"] is True
    assert run["engine"]["completed"] == run["sim"]["completed"] == run["engine"]["requests"] > 3
    assert run["engine_steps"] > 5 and run["sim_steps"] > 5
    # Bounds from what this shared machine gives (runs: errors with jitter TTFT p50 +13%/+47%/-77%,
    # TPOT p50 +5%/+6%/+83% (the last with seven test suites on two cores), throughput
    # −0.2%/−2.4%/+16% (a 6 s run ends in its drain)): throughput within 30%, TPOT within a
    # factor of 2, loose enough for a loaded machine, tight enough that a broken step model or
    # queue (an order of magnitude off) fails them.
    for key in ("relative_error", "relative_error_without_jitter"):
        err = run[key]
        assert set(err) == set(METRICS)
        assert err["throughput_rps"] == pytest.approx(0, abs=0.3)
        assert -0.5 <= err["tpot_p50_s"] <= 1.0
    # TTFT and the tails are not bounded: over 6 s the TTFT p50 error swung from -77% to +47%
    # and TBT p99's (with jitter) from -74% to +4% between runs here (a few requests, each one
    # queueing delay on a preempted core); the 240 s validation (docs/simulator.md) covers them
    assert run["cost_model"]["meta"]["fit_rate"] == 2.0
    printed = capsys.readouterr().out
    assert "sim, no jitter" in printed and "ttft_p50_s" in printed
