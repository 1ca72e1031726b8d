"""`loadgen.sim.bros_trace`: the accounting of what held BE back, on hand-made steps and on a
short fair-simulator run."""

from __future__ import annotations

import pytest

from engine.cost_model import CostModel, PhaseFit
from loadgen.sim.bros_trace import StepLog, _account, main

COST = CostModel(PhaseFit(1e-4, 0.0, 0.01), PhaseFit(1e-4, 0.0, 0.02), swap_bytes_per_s=1e9)


def _step(duration, be_rows, outstanding, on_host=0, no_memory=0, no_time=0, be_tokens=0):
    return StepLog(
        0.0,
        duration,
        10,
        be_tokens,
        be_rows,
        outstanding,
        on_host,
        0,
        0,
        0,
        0,
        no_memory,
        no_time,
        0,
        0,
        0,
        0.0,
        duration,
    )


def test_time_is_charged_to_the_first_reason_that_applies():
    logs = [
        _step(1.0, 4, 4, be_tokens=40),  # every BE request ran: nothing held back
        _step(2.0, 1, 4, on_host=1, no_memory=2),  # host first
        _step(3.0, 1, 4, no_memory=1, no_time=2),  # then memory
        _step(4.0, 0, 4, no_time=4),  # then time
        _step(5.0, 0, 2),  # a baseline: no reasons recorded; and the batch's tail (2 < 12 // 4)
    ]
    out = _account(logs, be_batch=12, cost=COST)
    assert out["simulated_busy_s"] == 15.0 and out["be_tokens_per_s"] == 40 / 15
    assert (out["time_be_out_host"], out["time_be_out_memory"], out["time_be_out_time"]) == (2.0, 3.0, 4.0)
    assert out["time_be_out_other"] == 5.0 and out["time_be_tail"] == 5.0
    assert out["fixed_cost_share"] == pytest.approx(0.01 * 5 / 15)
    assert out["time_with_be_in_batch"] == pytest.approx(6 / 15)


@pytest.mark.timeout(300)
def test_a_short_run_accounts_for_no_more_time_than_it_simulated(tmp_path, capsys):
    path = tmp_path / "trace.json"
    argv = ["--rate", "2", "--duration", "15", "--be-batch", "8", "--policies", "bros", "--json", str(path)]
    assert main(argv) == 0
    import json

    (run,) = json.loads(path.read_text())["runs"]
    held = sum(run[k] for k in run if k.startswith("time_be_out_"))
    assert 0 < run["be_tokens_per_s"] and held <= run["simulated_busy_s"] + 1e-9
    assert run["time_be_out_other"] == 0.0  # bros records its reasons
