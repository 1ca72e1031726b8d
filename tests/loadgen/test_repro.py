"""`tandem repro`: the golden simulator cell, the pipeline on a tiny cell, and the seams."""

from __future__ import annotations

import json
import math

import pytest

from loadgen.repro.base import Cell
from loadgen.repro.golden import PATH, golden_doc
from loadgen.repro.registry import REPROS
from loadgen.repro.run import cell_args, run_repro


def _same(a, b, path="") -> list[str]:
    """Differences between two JSON trees (floats to 1e-9 relative: the sim is deterministic)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only in one" for k in set(a) ^ set(b)]
        return out + [d for k in set(a) & set(b) for d in _same(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, (int, float)):
        return [] if math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) else [f"{path}: {a} != {b}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


@pytest.mark.timeout(300)
def test_golden_cell_matches_its_committed_json():
    want = json.loads(PATH.read_text())
    diffs = _same(golden_doc(), want)
    assert not diffs, "regenerate with `python -m loadgen.repro.golden` if meant:\n" + "\n".join(diffs[:20])
    # and the pinned cell says what the repro claims: BROS cuts RT latency vs the papers' vLLM
    assert want["ratios"]["bros"]["rt"]["normalized_latency_s"] < 0.7  # 0.62 when pinned: -38%


@pytest.mark.timeout(300)
def test_repro_writes_cells_and_readme(tmp_path, monkeypatch):
    tiny = Cell(
        "sim-sharegpt-r2",
        ("--workload", "rt-be", "--rate", "2", "--duration", "10", "--be-batch", "8"),
        ("fcfs-prefill-first", "rr", "bros"),
    )
    repro = REPROS["bros"]
    monkeypatch.setattr(repro, "cells", lambda quick, engine: [tiny])
    outcome = run_repro(repro, tmp_path, quick=True, engine=False)
    doc = json.loads((tmp_path / "sim-sharegpt-r2.json").read_text())
    assert doc["command"].startswith("tandem sim --workload rt-be") and "provenance" in doc
    assert "requests" not in doc and set(doc["targets"]) == {"fcfs-prefill-first", "rr", "bros"}
    readme = (tmp_path / "README.md").read_text()
    assert "| sharegpt: RT normalised latency vs vLLM | -74.20% |" in readme
    assert "## Not implemented" in readme and outcome.docs


@pytest.mark.timeout(600)
def test_aptserve_quick_repro_finds_rates_and_puts_them_beside_the_paper(tmp_path):
    outcome = run_repro(REPROS["aptserve"], tmp_path, quick=True, engine=False)
    (doc,) = outcome.docs.values()
    assert doc["command"].startswith("tandem sim --workload sharegpt") and "--find-rate" in doc["command"]
    eff = doc["effective_throughput"]
    assert set(eff) == {"fcfs-prefill-first", "fcfs", "aptserve"} and all(e["rate"] > 0 for e in eff.values())
    ratio = eff["aptserve"]["rate"] / eff["fcfs-prefill-first"]["rate"]
    row = f"| 90% | vLLM (`fcfs-prefill-first`) | 2.3x | {ratio:.2f}x [{ratio:.2f}, {ratio:.2f}] | 1 |"
    assert row in (tmp_path / "README.md").read_text().splitlines()
    assert json.loads((tmp_path / "sim-att0.9-seed0.json").read_text())["provenance"]["git"]["commit"]


@pytest.mark.timeout(600)
def test_ellm_quick_repro_runs_the_bench_and_puts_it_beside_the_paper(tmp_path):
    outcome = run_repro(REPROS["ellm"], tmp_path, quick=True, engine=False)
    (doc,) = outcome.docs.values()
    assert doc["command"] == "tandem bench ellm-sim --rates 2 --seeds 1 --duration 20 --policies fcfs,swap,ellm"
    agg = doc["rates"]["2.0"]["aggregate"]
    thr = agg["ellm"]["output_tokens_per_s"]["mean"] / agg["fcfs"]["output_tokens_per_s"]["mean"]
    assert thr > 0 and "provenance" in doc and "decisions" in doc["rates"]["2.0"]["per_seed"]["ellm"][0]
    row = f"| 2 req/s | vLLM-Recompute (`fcfs`) | 2.64x | {thr:.2f}x |"
    assert any(line.startswith(row) for line in (tmp_path / "README.md").read_text().splitlines())


def test_every_paper_has_cells_and_an_unknown_bench_is_refused():
    assert set(REPROS) == {"bros", "symphony", "aptserve", "ellm"}
    for repro in REPROS.values():
        assert repro.cells(quick=True, engine=False) and repro.cells(quick=False, engine=False)
    from loadgen.repro.run import run_cell

    with pytest.raises(ValueError, match="unknown bench"):
        run_cell(Cell("x", (), ("fcfs",), bench="nope"))
    assert REPROS["symphony"].cells(quick=True, engine=False)  # symphony has simulator cells


def test_repro_runs_a_subset_and_keeps_cells_already_written(tmp_path, monkeypatch):
    """`--only` / `--keep`: a long grid run in parts into one folder; the README covers every part."""
    from loadgen.repro import run as repro_run

    cells = [Cell(f"sim-x-u{u}", ("--workload", "rt-be", "--seeds", "3"), ("fcfs",)) for u in (1, 2, 3)]
    repro = REPROS["bros"]
    monkeypatch.setattr(repro, "cells", lambda quick, engine: cells)
    ran = []
    monkeypatch.setattr(repro_run, "run_cell", lambda cell: ran.append(cell) or {"command": cell.name})
    (tmp_path / "sim-x-u1.json").write_text(json.dumps({"command": "written before"}))
    outcome = run_repro(repro, tmp_path, quick=False, engine=False, only=("*-u2",), seeds=1, keep=True)
    assert [c.name for c in ran] == ["sim-x-u2"]  # u1 read back, u3 not selected
    assert ran[0].argv == ("--workload", "rt-be", "--seeds", "1")
    assert outcome.docs == {"sim-x-u1": {"command": "written before"}, "sim-x-u2": {"command": "sim-x-u2"}}
    assert json.loads((tmp_path / "sim-x-u2.json").read_text()) == {"command": "sim-x-u2"}


def test_with_seeds_replaces_or_adds_the_seed_count():
    from loadgen.repro.run import with_seeds

    cell = Cell("c", ("--rate", "2"), ("fcfs",))
    assert with_seeds(cell, None) is cell
    assert with_seeds(cell, 2).argv == ("--rate", "2", "--seeds", "2")
    assert with_seeds(with_seeds(cell, 2), 5).argv == ("--rate", "2", "--seeds", "5")
    with pytest.raises(ValueError, match="seeds"):
        with_seeds(cell, 0)


def test_bros_repro_shows_the_baselines_regime_beside_the_papers_vllm():
    """The BROS README puts our vLLM baseline's attainments beside the paper's (1.28% TTFT), per
    cell and over seeds, so a reader sees whether a ratio was measured in the paper's regime."""
    from loadgen.repro.bros import PAPER_REGIME_RATES, baseline_metric

    golden = json.loads(PATH.read_text())  # one run: summary, no seeds
    ttft = golden["summary"]["fcfs-prefill-first"]["rt"]["ttft_attainment"]
    assert baseline_metric(golden, "ttft_attainment") == (ttft, ttft, ttft)
    seeded = {
        "summary": golden["summary"],
        "seeds": {
            "metrics": {
                "fcfs-prefill-first": {
                    "rt": {
                        "ttft_attainment": {"values": [0.02, 0.04, None]},
                        "tpot_attainment": {"values": [0.9, 1.0]},
                        "normalized_latency_s": {"values": [0.1, 0.2]},
                    }
                }
            }
        },
    }
    lines = REPROS["bros"].figure({"sim-sharegpt-r2": seeded, "sim-lmsys-r3": golden, "engine-cpu-r1": golden})
    rows = [ln for ln in lines if ln.startswith("| sim-")]
    assert rows[0] == "| sim-sharegpt-r2 | 3.0% [2.0%, 4.0%] | 95.0% [90.0%, 100.0%] | 150 | 1.28% | 38% |"
    assert rows[1].startswith(f"| sim-lmsys-r3 | {ttft:.1%} ") and rows[1].endswith("| 1.28% | 29% |")
    assert len(rows) == 2  # engine cells are not the paper's setup
    assert REPROS["bros"].cells(quick=False, engine=False)[0].argv[5] == PAPER_REGIME_RATES[0]


def test_aptserve_full_cells_use_the_papers_trace_and_serve_every_request():
    """The paper's measurement: 1,000 requests per probe, and its client waits for every one (a
    request still open at our drain's end would count as a miss; the paper's counts it if it
    meets the SLO when it finishes), with its vLLM's max_num_seqs (256); a probe that cannot meet
    the target any more stops (`--decide-early`). Four seeds per level. The quick cells stay short."""
    full = [c for c in REPROS["aptserve"].cells(quick=False, engine=False) if c.name.startswith("sim-")]
    assert len(full) == 16  # 2 length profiles x 2 levels x 4 seeds
    for cell in full:
        args = cell_args(cell)
        assert args.requests == 1000 and args.drain_timeout >= 1e5 and args.find_rate
        assert args.max_num_seqs == 256 and args.decide_early
        # the paper's workload (OPT-tokenizer lengths) in `sim-opt-*`, BROS's lengths in `sim-att*`
        assert args.workload == ("sharegpt-opt" if cell.name.startswith("sim-opt-") else "sharegpt")
    assert {cell_args(c).workload for c in REPROS["aptserve"].cells(quick=True, engine=False)} == {"sharegpt"}
    quick = REPROS["aptserve"].cells(quick=True, engine=False)
    assert all(cell_args(c).requests is None and cell_args(c).drain_timeout is None for c in quick)


def test_symphony_long_history_group_runs_the_papers_prompt_size_on_its_128k_profile():
    """Issue 20: 8x needs ~15K-token prompts, which 8K-context sessions of mean 4 turns cannot
    produce. The `l2` cells run 40 turns per session on average on a 128K-context Llama-3.1-8B
    A100 profile, with a warm-up of about two session lengths before the measured window."""
    from loadgen.factory import load_cost_model
    from loadgen.repro.symphony import A100_128K, LONG_MEASURE_S, LONG_WARMUP_S, WINDOW_S, WINDOW_SEEDS

    cells = [c for c in REPROS["symphony"].cells(quick=False, engine=False) if c.name.startswith("sim-l2-")]
    window = [c for c in cells if c.name.endswith(f"-w{WINDOW_S}")]
    assert cells and all(c.name.split("-u")[-1].isdigit() for c in cells if c not in window)
    # session 12: recompute's and recompute-cached's light cells over a long window, more seeds
    assert {"sim-l2-recompute-u1-w12000", "sim-l2-recompute-u2-w12000", "sim-l2-recompute-cached-u1-w12000"} <= {
        c.name for c in window
    }
    for cell in cells:
        argv = list(cell.argv)
        value = lambda flag, argv=argv: argv[argv.index(flag) + 1]  # noqa: E731
        assert value("--turns-mean") == "40" and value("--cost-model") == A100_128K
        assert value("--warmup-s") == str(LONG_WARMUP_S)
        measure = WINDOW_S if cell in window else LONG_MEASURE_S
        assert value("--duration") == str(LONG_WARMUP_S + measure)
        assert value("--seeds") == str(WINDOW_SEEDS if cell in window else 3)
    others = [c for c in REPROS["symphony"].cells(quick=False, engine=False) if c.name.startswith("sim-a2-")]
    assert others and all("--turns-mean" not in c.argv for c in others)  # the other groups unchanged
    profile = load_cost_model(A100_128K)
    assert profile.meta["max_model_len"] == 131072  # a 15K-token history fits
    # decode pays each context token's K/V read from HBM: 128 KiB at 80% of 1,935 GB/s
    assert profile.decode.alpha1 == pytest.approx(131072 / (1.935e12 * 0.8), rel=0.05)


def test_aptserve_figure_puts_each_length_profile_in_its_own_table():
    """The OPT-length cells get their own table; the BROS-length table is unchanged by them."""

    def doc(ours: float, base: float) -> dict:
        return {"effective_throughput": {"aptserve": {"rate": ours}, "fcfs-prefill-first": {"rate": base}}}

    lines = REPROS["aptserve"].figure({"sim-att0.9-seed0": doc(5.0, 2.5), "sim-opt-att0.9-seed0": doc(6.0, 2.0)})
    opt_title = next(i for i, ln in enumerate(lines) if "OPT-tokenizer" in ln)
    row = "| 90% | vLLM (`fcfs-prefill-first`) | 2.3x | {} | 1 |"
    assert lines.index(row.format("2.00x [2.00, 2.00]")) < opt_title < lines.index(row.format("3.00x [3.00, 3.00]"))
