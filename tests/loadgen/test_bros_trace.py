"""`loadgen.sim.bros_trace`: the accounting of what held BE back, on hand-made steps and on a
short fair-simulator run."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from engine.cost_model import CostModel, PhaseFit
from loadgen.metrics import RequestRecord
from loadgen.sim.bros_trace import StepLog, _account, main, rt_latency_parts, rt_step_parts, windows

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
    assert main([*argv, "--windows", "5", "--steps"]) == 0
    import json

    (run,) = json.loads(path.read_text())["runs"]
    held = sum(run[k] for k in run if k.startswith("time_be_out_"))
    assert 0 < run["be_tokens_per_s"] and held <= run["simulated_busy_s"] + 1e-9
    assert run["time_be_out_other"] == 0.0  # bros records its reasons
    assert sum(w["steps"] for w in run["windows"]) == run["steps_count"] == len(run["steps"])
    parts = run["rt_latency_parts"]
    assert parts["ttft_part_s"] + parts["decode_part_s"] == pytest.approx(run["rt_normalized_latency_s"])
    waits = run["rt_step_parts"]  # the parts of the step RT's decode rows wait for add up to it
    assert waits["step_s"] > 0 and waits["rt_alone_s"] > 0
    assert waits["rt_alone_s"] + waits["be_decode_rows_s"] + waits["be_prefill_s"] == pytest.approx(waits["step_s"])
    # the windows of a --steps file, computed afterwards, are the ones written with the run
    out = tmp_path / "windows.json"
    assert main(["--summarize", str(path), "--windows", "5", "--json", str(out)]) == 0
    summarized = json.loads(out.read_text())
    assert summarized["runs"][0]["windows"] == run["windows"] and "steps" not in summarized["runs"][0]
    assert summarized["provenance"] == json.loads(path.read_text())["provenance"]


def test_windows_sum_steps_by_simulated_time():
    steps = [asdict(_step(1.0, 1, 4, on_host=2, be_tokens=10)) for _ in range(3)]
    for i, s in enumerate(steps):
        s["start_s"] = float(i)  # steps at 0, 1 and 2 s: windows of 2 s hold two, then one
    first, second = windows(steps, 2.0)
    assert (first["start_s"], first["steps"], second["start_s"], second["steps"]) == (0.0, 2, 2.0, 1)
    assert first["be_tokens_per_s"] == 10.0 and first["rt_tokens_per_s"] == 10.0 and first["be_on_host"] == 2


def test_rt_latency_parts_split_normalised_latency():
    rt = RequestRecord("r", "rt", arrival_s=0.0, prompt_tokens=4, max_tokens=4, token_times_s=[1.0, 1.5, 2.0, 3.0])
    rt.finish_s = 3.0
    be = RequestRecord("b", "be", arrival_s=0.0, prompt_tokens=4, max_tokens=1, token_times_s=[9.0])
    be.finish_s = 9.0
    parts = rt_latency_parts([rt, be])  # BE does not count
    assert parts["ttft_part_s"] == pytest.approx(1.0 / 4) and parts["decode_part_s"] == pytest.approx(2.0 / 4)
    assert parts["gap_mean_s"] == pytest.approx(2.0 / 3) and parts["gap_p90_s"] == pytest.approx(0.5)


def test_rt_step_parts_weigh_steps_by_rt_decode_rows():
    # two steps: 3 RT decode rows in a 0.1 s step (0.05 s RT alone, +0.01 s BE decode rows, +0.04 s
    # BE prefill), 1 row in a 0.04 s step whose pass the noise stretched from 0.02 s (RT alone)
    a = _step(0.1, 2, 2)
    a.rt_decode_rows, a.exec_s, a.exec_rt_s, a.exec_rt_be_decode_s = 3, 0.1, 0.05, 0.06
    b = _step(0.04, 0, 0)
    b.rt_decode_rows, b.exec_s, b.exec_rt_s, b.exec_rt_be_decode_s = 1, 0.02, 0.02, 0.02
    no_rt = _step(5.0, 1, 1)  # a step without RT decode rows does not count
    parts = rt_step_parts([a, b, no_rt])
    assert parts["step_s"] == pytest.approx(0.75 * 0.1 + 0.25 * 0.04)
    assert parts["rt_alone_s"] == pytest.approx(0.75 * 0.05 + 0.25 * 0.04)
    assert parts["be_decode_rows_s"] == pytest.approx(0.75 * 0.01)
    assert parts["be_prefill_s"] == pytest.approx(0.75 * 0.04)
