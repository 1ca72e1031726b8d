"""Every benchmark document that runs a cost-model policy says which profile each policy planned
from (engine/profile_cache.py): `tandem bench policies` on the in-process engine, one round and
alternating rounds, with a tiny model and its own profile cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _bench(tmp_path, *extra: str) -> dict:
    path = tmp_path / f"doc{len(list(tmp_path.glob('doc*.json')))}.json"
    env = {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path / "cache")}
    args = ("--target", "inproc", "--policies", "fcfs,bros", "--duration", "2", "--rate", "2")
    res = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "policies", *args, *extra, "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(path.read_text())


@pytest.mark.timeout(900)
def test_bench_policies_records_the_profile_each_policy_planned_from(tmp_path, tiny_model_dir):
    model = ("--model", str(tiny_model_dir("llama")), "--dtype", "float32", "--num-blocks", "128")
    small = ("--length-scale", "0.05", "--slo-scale", "1", "--max-num-seqs", "8", "--max-num-batched-tokens", "128")
    doc = _bench(tmp_path, *model, *small)
    bros = doc["profiles"]["bros"]
    assert doc["profiles"]["fcfs"] is None  # fcfs plans from nothing
    assert bros["status"] == "fresh" and bros["path"].startswith(str(tmp_path / "cache" / "profiles"))
    assert isinstance(bros["trusted"], bool) and bros["load_per_cpu_at_fit"] >= 0
    assert set(bros["fit_error"]) == {"prefill", "decode", "mixed"} and bros["conditions"]["wall_s"] > 0
    assert doc["runs"]["bros"]["target"]["cost_model_profile"] == bros
    # rounds: every run says what it planned from; the profile measured above is cached now
    # (used as it is, or measured again when it had doubts and the host is quiet: either is recorded)
    rounds = _bench(tmp_path, *model, *small, "--rounds", "2")["rounds"]
    for r in rounds:
        assert r["runs"]["fcfs"]["profile"] is None
        record = r["runs"]["bros"]["profile"]
        assert record["status"] in ("cached", "retaken") and record["key"] == bros["key"]
        assert record["trusted"] == (not record["doubts"])
