"""`loadgen.sim.probe_trace`: one probe of a repro cell, recorded step by step, decides as the
unrecorded probe does, and its miss split and step statistics add up."""

from __future__ import annotations

import argparse

import pytest

from loadgen.cli import add_run_args
from loadgen.metrics import RequestRecord, summarize
from loadgen.orchestrate import _SloScale, run_once
from loadgen.sim.probe_trace import cell_argv, miss_split, probe

SMALL = (
    *("--workload", "sharegpt-opt", "--cost-model", "opt-13b-a100-40gb", "--slo-ttft", "1", "--slo-tpot", "1"),
    *("--duration", "20", "--max-num-seqs", "256", "--drain-timeout", "100000", "--seed", "1"),
)


def test_cell_argv_is_the_cells_setup_without_the_search():
    argv = cell_argv("aptserve", "sim-opt-att0.6-seed2")
    assert "--find-rate" not in argv and "--decide-early" not in argv and "--attainment" not in argv
    text = " ".join(argv)
    assert "--workload sharegpt-opt" in text and "--seed 2" in text and "--max-num-seqs 256" in text
    assert "--requests 1000" in text and "--drain-timeout 100000" in text
    with pytest.raises(SystemExit):
        cell_argv("aptserve", "no-such-cell")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["fcfs-prefill-first", "aptserve"])
def test_recorded_probe_decides_as_the_unrecorded_one(policy):
    p = argparse.ArgumentParser()
    add_run_args(p, target_default="sim")
    args = p.parse_args([*SMALL, "--no-progress"])
    plain = run_once(args, policy, _SloScale(args), 6.0, progress=False)
    want = summarize(plain.records, plain.elapsed_s)["rt"]
    got = probe(SMALL, policy, 6.0)
    assert got["slo_attainment"] == want["slo_attainment"] and got["elapsed_s"] == plain.elapsed_s
    assert got["ttft_attainment"] == want["ttft_attainment"] and got["completed"] == want["completed"]
    # every miss is counted once, in exactly one group
    missed = sum(got["misses"].values())
    assert missed == round(got["requests"] * (1 - got["slo_attainment"]))
    assert got["steps"] > got["prefill_steps"] > 0 and got["max_batch"] >= got["mean_decode_batch"] > 1
    assert got["max_num_seqs"] == 256
    # 6 req/s of OPT-length requests binds the A100's pool: some steps run at the memory limit
    assert 0 < got["time_share_at_memory_limit"] <= 1
    # at the paper's pool HIDDEN is never kept (docs/aptserve.md): no rebuild is paid
    assert got["hidden_rows"] == 0 and got["mean_rebuild_s_per_step"] == 0.0


def _rec(rid: str, times: list[float], finished: bool = True) -> RequestRecord:
    rec = RequestRecord(rid, "rt", 0.0, 4, len(times), slo_ttft_s=1.0, slo_tpot_s=1.0)
    rec.token_times_s = times
    rec.finish_s = times[-1] if finished else None
    return rec


def test_miss_split_counts_each_miss_once_and_the_stalls_p99_hides():
    steady = [0.5 + 0.1 * i for i in range(300)]
    # one 120 s stall among 299 gaps: P99 (linear) ignores it, so the request is met
    stalled = [0.5 + 0.1 * i for i in range(150)] + [135.5 + 0.1 * i for i in range(150)]
    choppy = [0.5, 2.0, 3.5]  # two gaps of 1.5 s: P99 TBT missed
    records = [
        _rec("ok", steady),
        _rec("stalled", stalled),
        _rec("late", [1.5 + 0.1 * i for i in range(10)]),
        _rec("late-choppy", [1.5, 3.0, 4.5]),
        _rec("choppy", choppy),
        _rec("open", [0.5], finished=False),
    ]
    misses, stalled_but_met = miss_split(records)
    assert misses == {"ttft_only": 1, "tbt_only": 1, "both": 1, "not_completed": 1}
    assert stalled_but_met == 1
