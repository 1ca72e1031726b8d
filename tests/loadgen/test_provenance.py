"""Provenance stamps (loadgen/provenance.py) and the results that must carry them."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import sys

import pytest
import torch

from kernels.cpu_caps import probe
from loadgen import provenance
from loadgen.provenance import REPO_ROOT, same_host, stamp

HAS_GIT = shutil.which("git") is not None and (REPO_ROOT / ".git").exists()


def test_stamp_names_code_host_software_threads_and_dtype():
    prov = stamp(dtype="bfloat16", packages=("httpx",), extra={"target": "x"}).as_dict()
    json.dumps(prov)  # plain JSON all the way down
    assert prov["schema_version"] == provenance.SCHEMA_VERSION
    ts = dt.datetime.strptime(prov["timestamp_utc"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    assert abs((dt.datetime.now(dt.UTC) - ts).total_seconds()) < 600
    cpu = prov["host"]["cpu"]
    assert {k: cpu[k] for k in probe().as_dict()} == json.loads(json.dumps(probe().as_dict()))
    assert cpu["source"] == "kernels.cpu_caps"
    assert prov["host"]["logical_cpus"] >= prov["host"]["physical_cores"] >= 1
    assert prov["versions"]["torch"] == torch.__version__
    assert prov["versions"]["httpx"] not in ("", "absent")
    assert prov["python"] == sys.version.split()[0]
    assert prov["threads"]["torch_num_threads"] == torch.get_num_threads()
    assert prov["dtype"] == "bfloat16"
    assert len(prov["load_average"]) == 3 and min(prov["load_average"]) >= 0
    assert prov["extra"] == {"target": "x"}


@pytest.mark.skipif(not HAS_GIT, reason="not a git checkout")
def test_git_commit_and_dirty_flag_match_git():
    info = provenance.git_info()
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert info.commit == head.stdout.strip()
    status = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    assert info.dirty is bool(status.stdout.strip())


def test_without_git_commit_and_dirty_are_unknown(tmp_path, monkeypatch):
    assert provenance.git_info(tmp_path) == provenance.GitInfo("unknown", "unknown")  # not a checkout
    monkeypatch.setenv("PATH", str(tmp_path))  # no git binary at all
    assert provenance.git_info() == provenance.GitInfo("unknown", "unknown")
    assert stamp().git.commit == "unknown"


def test_thread_settings_pick_openmp_vllm_and_isa_variables():
    env = {
        "OMP_NUM_THREADS": "2",
        "VLLM_CPU_OMP_THREADS_BIND": "0,1",
        "KMP_AFFINITY": "compact",
        "ATEN_CPU_CAPABILITY": "avx2",
        "HOME": "/root",
        "VLLM_LOGGING_LEVEL": "INFO",
    }
    got = provenance.thread_settings(env).env
    assert got == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "KMP_AFFINITY": "compact",
        "OMP_NUM_THREADS": "2",
        "VLLM_CPU_OMP_THREADS_BIND": "0,1",
    }


def test_cpu_falls_back_to_proc_cpuinfo_without_kernels(monkeypatch):
    monkeypatch.setitem(sys.modules, "kernels.cpu_caps", None)  # import fails as in a torch-less venv
    cpu = provenance.cpu_description()
    assert cpu["source"].startswith("/proc/cpuinfo")
    assert cpu["model"] == probe().model
    assert set(probe().flags) <= set(cpu["flags"])  # uncapped here: the same flags


def test_missing_package_is_absent_and_an_imported_module_answers_for_itself(monkeypatch):
    assert provenance.package_versions(["no-such-package-xyz"]) == {"no-such-package-xyz": "absent"}
    fake = type(sys)("fake_engine_xyz")
    fake.__version__ = "0.32.0"
    monkeypatch.setitem(sys.modules, "fake_engine_xyz", fake)  # as vllm (distribution vllm-cpu) is
    assert provenance.package_versions(["fake-engine-xyz"]) == {"fake-engine-xyz": "0.32.0"}


def test_same_host_compares_the_machine_not_the_moment():
    a = stamp(dtype="float32").as_dict()
    b = stamp(dtype="bfloat16").as_dict()
    assert same_host(a, b)
    other = json.loads(json.dumps(b))
    other["host"]["cpu"]["model"] = "Some Other CPU"
    assert not same_host(a, other)
    assert not same_host(a, None)
    assert not same_host()


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT
    )


@pytest.mark.timeout(300)
def test_bench_engine_json_carries_the_stamp(tmp_path, tiny_model_dir):
    out = tmp_path / "engine.json"
    model = tiny_model_dir("llama")
    res = _tandem(
        *("bench", "engine", "--model", str(model), "--num-prompts", "2", "--input-len", "8", "12"),
        *("--output-len", "3", "--dtype", "float32", "--kv-cache-gib", "0.05", "--json", str(out), "--quiet"),
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    prov = doc["provenance"]
    assert prov["dtype"] == "float32" == doc["config"]["dtype"]
    assert prov["host"]["cpu"]["model"] == probe().model
    assert prov["threads"]["torch_num_threads"] >= 1
    assert prov["git"]["commit"] == provenance.git_info().commit
    assert same_host(prov, stamp().as_dict())


@pytest.mark.timeout(300)
def test_bench_engine_runs_partial_residency(tmp_path, tiny_model_dir):
    """`--uncached-ratio` reaches the engine (so the GPU plan can benchmark eLLM's form) and
    every requested token is still produced."""
    out = tmp_path / "engine.json"
    res = _tandem(
        *("bench", "engine", "--model", str(tiny_model_dir("llama")), "--num-prompts", "3", "--input-len", "40", "60"),
        *("--output-len", "4", "--dtype", "float32", "--uncached-ratio", "0.5", "--json", str(out), "--quiet"),
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    assert doc["config"]["engine_config"]["uncached_ratio"] == 0.5
    assert doc["output_tokens"] == 12
    # the per-step and per-request timeline (where first tokens wait) accounts for every token
    timeline = doc["timeline"]
    # the warm-up prompt is outside the workload (warmup_prompt): no prompt starts on a cached block
    assert doc["num_cached_prompt_tokens"] == 0
    assert sum(s["prefill_tokens"] for s in timeline["steps"]) == doc["input_tokens"]
    assert sum(s["sampled"] for s in timeline["steps"]) == 12
    assert sum(s["first_tokens"] for s in timeline["steps"]) == 3
    for r in timeline["requests"]:
        assert 0 <= r["arrival_s"] <= r["first_scheduled_s"] <= r["first_token_s"] <= r["finish_s"]
        step = timeline["steps"][r["first_token_step"]]
        assert step["start_s"] <= r["first_token_s"] <= step["end_s"]
    assert timeline["ttft_breakdown"]["ttft_p50_s"] == doc["ttft_p50_s"]


@pytest.mark.timeout(300)
def test_sim_results_carry_the_stamp(tmp_path):
    out = tmp_path / "sim"
    res = _tandem("sim", "--duration", "5", "--rate", "2", "--length-scale", "0.25", "--out", str(out))
    assert res.returncode == 0, res.stderr
    prov = json.loads((out / "results.json").read_text())["provenance"]
    assert f"Measured at `{prov['git']['commit'][:7]}" in (out / "summary.md").read_text()
    assert prov["extra"] == {"target": "sim"}
    assert prov["dtype"] in ("float32", "bfloat16")  # "auto" decided as the engine would
    assert prov["host"]["logical_cpus"] == probe().logical_cpus
