"""`tandem bench ellm-decision` and `tandem bench ellm-sim` as a user runs them: the JSON holds
the timings / per-seed summaries, the ellm policy's decision totals and the provenance stamp."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.cost_model import CostModel, PhaseFit


def tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.timeout(300)
def test_ellm_decision_bench_writes_timings(tmp_path):
    path = tmp_path / "d.json"
    res = tandem("bench", "ellm-decision", "--sizes", "16,64", "--repeats", "5", "--json", str(path))
    assert res.returncode == 0, res.stderr
    doc = json.loads(path.read_text())
    assert [(r["candidates"], r["pool"]) for r in doc["rows"]] == [
        (16, "memory binds"),
        (16, "all fit"),
        (64, "memory binds"),
        (64, "all fit"),
    ]
    for row in doc["rows"]:
        assert 0 < row["median_s"] <= row["max_s"] and row["cpu_median_s"] >= 0
    binds, fits = doc["rows"][2], doc["rows"][3]
    assert binds["chosen_batch"] < 64 and fits["chosen_batch"] == 64
    assert doc["provenance"]["git"]["commit"]


@pytest.mark.timeout(300)
def test_ellm_sim_bench_rebuilds_where_it_pays(tmp_path):
    """A profile where re-prefilling the pool costs less than a step's constant
    (c_p * C = 2e-5 s x 768 tokens < 0.02 s): ellm rebuilds, and the JSON says so per seed."""
    profile = tmp_path / "cheap.json"
    CostModel(
        PhaseFit(2e-5, 1e-9, 0.01),
        PhaseFit(2e-4, 1e-8, 0.02),
        1e9,
        {"kv_bytes_per_token": 100_000, "block_size": 16, "max_model_len": 2048},
    ).save(profile)
    path = tmp_path / "s.json"
    res = tandem(
        "bench",
        "ellm-sim",
        "--cost-model",
        str(profile),
        "--workload",
        "sharegpt",
        "--num-blocks",
        "48",
        "--rates",
        "4",
        "--seed",
        "1",
        "--seeds",
        "2",
        "--duration",
        "15",
        "--length-scale",
        "0.5",
        "--slo-tpot",
        "0.2",
        "--slo-ttft",
        "2",
        "--json",
        str(path),
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(path.read_text())
    rate = doc["rates"]["4.0"]
    assert set(rate["per_seed"]) == {"fcfs", "swap", "ellm"}
    assert all(len(runs) == 2 for runs in rate["per_seed"].values())
    assert "decisions" not in rate["per_seed"]["fcfs"][0]
    for run in rate["per_seed"]["ellm"]:
        decisions = run["decisions"]
        assert decisions["steps"] > 0 and decisions["rebuilding_step_share"] > 0 and decisions["max_ratio"] > 0
    agg = rate["aggregate"]["fcfs"]["output_tokens_per_s"]
    assert agg["min"] <= agg["mean"] <= agg["max"]
    assert doc["provenance"]["git"]["commit"]


@pytest.mark.timeout(300)
def test_inproc_target_publishes_ellm_decision_time(tiny_model_dir, tmp_path):
    """The in-process engine's description (what `tandem bench policies` writes per run) carries
    ellm's `DecisionStats`, with its decision time measured inside the engine per step, wall
    and CPU; a policy without such totals gives None."""
    from engine import EngineConfig, SamplingParams
    from loadgen.targets.inproc import InprocTarget

    cost = tmp_path / "cost.json"
    CostModel(PhaseFit(2e-5, 1e-9, 0.01), PhaseFit(2e-4, 1e-8, 0.02), 1e9, {"model": "test"}).save(cost)
    common = dict(model=str(tiny_model_dir("llama")), dtype="float32", num_blocks=14, cost_model_path=str(cost))
    target = InprocTarget.from_config(EngineConfig(policy="ellm", rt_tpot_s=1.0, **common))
    engine = target.engine
    for i in range(4):
        prompt = [1000 + 7 * i + j for j in range(50 + 5 * i)]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    stats = target.describe()["policy_stats"]
    assert stats["steps"] == engine.stats.steps and stats["max_ratio"] > 0
    assert 0 < stats["p50_decision_cpu_s"] <= stats["max_decision_cpu_s"]
    assert 0 < stats["p50_decision_s"] <= stats["max_decision_s"]
    assert InprocTarget.from_config(EngineConfig(policy="fcfs", **common)).describe()["policy_stats"] is None


def test_tandem_bench_ellm_parses_like_the_module():
    """`tandem bench ellm` takes `tandem bench policies`'s arguments and defaults (what
    `python -m loadgen.bench.ellm_ab` passes through), plus rounds, policies and `--json`
    (`--rounds` is both commands' own option, with its own default)."""
    from loadgen.bench import ellm_ab
    from services.cli import build_parser

    argv = ["--workload", "sharegpt", "--num-blocks", "32", "--prefix-source", "auto"]
    ours = build_parser().parse_args(["bench", "ellm", "--json", "out.json", "--rounds", "2", *argv])
    module = ellm_ab._run_args(argv)
    assert ours.func is ellm_ab._run_cli and (ours.rounds, ours.json_path) == (2, "out.json")
    assert ours.policies == "fcfs,swap,ellm"
    shared = set(vars(module)) - {"func", "policies", "json_path", "bench_command", "rounds"}
    assert {k: getattr(ours, k) for k in shared} == {k: getattr(module, k) for k in shared}


@pytest.mark.timeout(300)
def test_ellm_decision_ab_alternates_two_checkouts(tmp_path):
    """`bench ellm-decision-ab` with one checkout on both sides (a short cell): each round runs
    both, in swapped order, each run carries its decision times and its own stamp, and the
    same code decides the same (identical simulated outcome)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    path = tmp_path / "ab.json"
    res = tandem(
        "bench", "ellm-decision-ab", "--old", str(root), "--new", str(root), "--rounds", "2", "--duration", "3",
        "--json", str(path),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    doc = json.loads(path.read_text())
    assert [list(r) for r in doc["rounds"]] == [["old", "new"], ["new", "old"]]
    assert doc["same_outcome"] is True
    for rd in doc["rounds"]:
        for run in rd.values():
            d = run["decisions"]
            assert d["steps"] > 0 and 0 < d["p50_decision_cpu_s"] <= d["p99_decision_cpu_s"] <= d["max_decision_cpu_s"]
            assert run["provenance"]["git"]["commit"] == doc["provenance"]["git"]["commit"]
    assert doc["median_over_rounds"]["new"]["p99_decision_cpu_s"] > 0


@pytest.mark.timeout(300)
def test_ellm_decision_ab_runs_the_long_queue_cell(tmp_path):
    """`--cell rate16` runs the 16 req/s cell (FLOPs-priced attention, the paper's 40 GB host)
    on both sides and names it in the JSON; one short round."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    path = tmp_path / "ab16.json"
    res = tandem(
        "bench", "ellm-decision-ab", "--old", str(root), "--new", str(root), "--rounds", "1", "--duration", "2",
        "--cell", "rate16", "--json", str(path),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    doc = json.loads(path.read_text())
    assert doc["cell_name"] == "rate16" and "16" in doc["cell"] and "37.25" in doc["cell"]
    assert doc["same_outcome"] is True
    assert all(run["decisions"]["steps"] > 0 for run in doc["rounds"][0].values())
