"""`python -m loadgen.bench.hybrid` end to end on a tiny MHA model (OPT) with a given profile:
every policy runs on the same arrivals, and the rebuild columns count only rows that rebuild
K/V from stored context (a HIDDEN first prefill has none: the old bench's 0.0)."""

from __future__ import annotations

import json

from engine.cost_model import CostModel, PhaseFit
from loadgen.bench import hybrid


def test_hybrid_bench_runs_every_policy_and_splits_hidden_rows(tiny_model_dir, tmp_path):
    cost = tmp_path / "cost.json"
    # a cheap rebuild (so aptserve picks HIDDEN under this pool) and a 0.1 ms/token prefill
    CostModel(PhaseFit(1e-4, 1e-8, 1e-3), PhaseFit(1e-4, 1e-8, 1e-3), 1e9, {}, 1e-9).save(cost)
    out = tmp_path / "hybrid.json"
    argv = [
        *("--model", str(tiny_model_dir("opt")), "--num-blocks", "12", "--max-model-len", "256"),
        *("--rate", "8", "--duration", "1", "--length-scale", "0.1", "--seeds", "0"),
        *("--cost-model", str(cost), "--out", str(out)),
    ]
    assert hybrid.main(argv) == 0
    doc = json.loads(out.read_text())
    runs = {r["policy"]: r for r in doc["runs"]}
    assert set(runs) == {"fcfs", "aptserve", "aptserve-priced"}
    assert len({r["requests"] for r in runs.values()}) == 1  # the same arrivals
    assert runs["fcfs"]["hidden_rows"] == 0 and runs["fcfs"]["mean_rebuild_s_per_hidden_step"] is None
    for r in runs.values():
        assert r["hidden_rebuild_rows"] <= r["hidden_rows"] <= r["row_count"]
        assert (r["mean_rebuild_s_per_hidden_step"] is None) == (r["steps_rebuilding"] == 0)
    assert doc["profile"]["per_token_s"] == 1e-9 and doc["provenance"]["git"]
