"""`tandem sim`, `tandem loadgen` and `tandem bench policies` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

KEYS = (
    "requests",
    "completed",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tbt_p99_s",
    "normalized_latency_s",
    "ttft_attainment",
    "tpot_attainment",
    "slo_attainment",
    "throughput_rps",
    "output_tokens_per_s",
)


# Safety nets sized for a starved host: `loadgen run --target inproc` on the tiny model took 299 s
# of the 300 s these used to be at load 30-55 (torch's import, the engine's build, the run).
RUN_TIMEOUT_S = 540


def tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )


@pytest.mark.timeout(600)
def test_sim_comparison_writes_report(tmp_path):
    out = tmp_path / "sim"
    res = tandem(
        "sim",
        "--workload",
        "rt-be",
        "--rate",
        "2",
        "--duration",
        "30",
        "--policies",
        "fcfs,rr",
        "--out",
        str(out),
        "--find-rate",
        "--attainment",
        "0.5",
        "--length-scale",
        "0.5",
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads((out / "results.json").read_text())
    for policy in ("fcfs", "rr"):
        for cls in ("rt", "be", "all"):
            assert all(k in doc["summary"][policy][cls] for k in KEYS)
        assert doc["runs"][policy]["requests"]
        assert doc["effective_throughput"][policy]["probes"]
    assert doc["ratios"]["baseline"] == "fcfs"
    for png in ("ttft_cdf.png", "timeline.png", "attainment_vs_rate.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert "## RT requests" in (out / "summary.md").read_text()


@pytest.mark.timeout(600)
def test_bench_policies_json_holds_a_summary_per_policy(tmp_path):
    path = tmp_path / "p.json"
    res = tandem(
        "bench",
        "policies",
        "--target",
        "sim",
        "--policies",
        "fcfs,rr",
        "--duration",
        "20",
        "--slo-scale",
        "1",
        "--rate",
        "2",
        "--json",
        str(path),
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(path.read_text())
    assert set(doc["summary"]) == {"fcfs", "rr"}
    assert doc["config"]["length_scale"] == 0.25 and doc["config"]["workload"] == "rt-be"


@pytest.mark.timeout(600)
def test_loadgen_run_inproc(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    res = tandem(
        "loadgen",
        "run",
        "--target",
        "inproc",
        "--model",
        str(tiny_model_dir("llama")),
        "--dtype",
        "float32",
        "--workload",
        "sharegpt",
        "--rate",
        "4",
        "--duration",
        "3",
        "--length-scale",
        "0.1",
        "--slo-scale",
        "auto",
        "--out",
        str(out),
        "--num-blocks",
        "256",
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads((out / "results.json").read_text())
    assert doc["summary"]["rt"]["completed"] == doc["summary"]["rt"]["requests"] > 3
    assert doc["config"]["slo_scale_detail"]["slo_scale"] > 0
    assert doc["load"] and 0 <= doc["load"][0]["kv_usage"] <= 1


def test_bad_input_is_a_clear_error():
    res = tandem("sim", "--workload", "sharegpt", "--rate", "-1", "--duration", "5")
    assert res.returncode == 2 and "tandem: error:" in res.stderr
    res = tandem("sim", "--cost-model", "no-such-profile", "--duration", "5")
    assert res.returncode == 2 and "no-such-profile" in res.stderr


def test_cost_model_help_names_every_shipped_profile():
    """`--cost-model` takes a file or any profile shipped in loadgen/sim/profiles: its help names
    each (it once named two of four, and no default for inproc)."""
    import argparse

    from loadgen.cli import add_run_args
    from loadgen.factory import PROFILE_DIR, load_cost_model

    parser = argparse.ArgumentParser(prog="tandem sim")
    add_run_args(parser, target_default="sim")
    text = next(a.help for a in parser._actions if "--cost-model" in a.option_strings)  # noqa: SLF001
    names = sorted(f.stem for f in PROFILE_DIR.glob("*.json"))
    assert len(names) >= 4 and "inproc" in text
    for name in names:
        assert name in text, name
        assert load_cost_model(name).meta is not None  # each named one loads by that name


@pytest.mark.timeout(600)
def test_sim_bros_with_explicit_slos(tmp_path):
    """BROS takes default SLOs and the cost model: both reach it through the simulator's workers."""
    out = tmp_path / "bros"
    res = tandem(
        "sim",
        "--workload",
        "rt-be",
        "--rate",
        "2",
        "--duration",
        "20",
        "--policies",
        "fcfs,bros",
        "--slo-ttft",
        "0.4",
        "--slo-tpot",
        "0.2",
        "--out",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads((out / "results.json").read_text())
    bros, fcfs = doc["summary"]["bros"]["rt"], doc["summary"]["fcfs"]["rt"]
    assert bros["completed"] == bros["requests"] == fcfs["requests"]
    assert bros["ttft_attainment"] > fcfs["ttft_attainment"]  # slack scheduling puts RT first


@pytest.mark.timeout(600)
def test_bench_policies_counts_what_the_capped_drain_left_unfinished(tmp_path):
    """Past its collapse a policy still yields numbers: the drain is capped, what is left is
    aborted, and the document and report count it per class (RT 30 req/s for 5 s with a 1 s
    drain leaves RT requests open on the simulated A100)."""
    path = tmp_path / "p.json"
    res = tandem(
        "bench", "policies", "--target", "sim", "--policies", "fcfs-prefill-first", "--duration", "5",
        "--slo-scale", "1", "--rate", "30", "--drain-timeout", "1", "--json", str(path),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    doc = json.loads(path.read_text())
    rt = doc["summary"]["fcfs-prefill-first"]["rt"]
    left = doc["unfinished"]["fcfs-prefill-first"]
    assert left["rt"] == rt["requests"] - rt["completed"] > 0
    assert left["be"] >= 0 and f"- fcfs-prefill-first: RT {left['rt']}, BE {left['be']} -- RT latency" in res.stdout


@pytest.mark.timeout(600)
def test_bench_policies_rounds_alternate_the_order_and_record_the_load(tmp_path):
    """`--rounds 2`: the second round runs the policies in the opposite order, every run keeps
    its summary and the load average around it, and the ratios are per round (the first
    policy is the baseline in every round, whatever order it ran in)."""
    path = tmp_path / "r.json"
    res = tandem(
        "bench", "policies", "--target", "sim", "--policies", "fcfs,bros", "--duration", "5",
        "--slo-scale", "1", "--rate", "2", "--rounds", "2", "--json", str(path),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    doc = json.loads(path.read_text())
    assert [r["order"] for r in doc["rounds"]] == [["fcfs", "bros"], ["bros", "fcfs"]]
    for r in doc["rounds"]:
        assert r["ratios"]["baseline"] == "fcfs"
        for run in r["runs"].values():
            assert len(run["load_before"]) == len(run["load_after"]) == 3 and run["wall_s"] > 0
            assert run["summary"]["rt"]["requests"] > 0
    lat = doc["rounds_ratios"]["bros"]["rt.normalized_latency_s"]
    assert lat["per_round"] == [r["ratios"]["bros"]["rt"]["normalized_latency_s"] for r in doc["rounds"]]
    assert lat["min"] <= lat["median"] <= lat["max"]
    assert doc["provenance"]["git"]["commit"]
    auto = tandem("bench", "policies", "--target", "sim", "--policies", "fcfs,bros", "--rounds", "2")
    assert auto.returncode == 2 and "fixed --slo-scale" in auto.stderr  # SLOs measured per run: refused
