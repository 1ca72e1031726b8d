"""Run a paper's cells and write `<out>/<cell>.json` plus `<out>/README.md`."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from loadgen.repro.base import Cell, Outcome, PaperRow, Repro

_KEEP = ("config", "summary", "ratios", "seeds", "effective_throughput", "provenance")


def cell_args(cell: Cell) -> argparse.Namespace:
    from loadgen.cli import add_run_args

    p = argparse.ArgumentParser(prog=f"tandem {'loadgen compare' if cell.engine else 'sim'}")
    add_run_args(p, target_default="inproc" if cell.engine else "sim")
    return p.parse_args([*cell.argv, "--no-progress"])


def run_cell(cell: Cell) -> dict:
    """One cell's compact document: what results.json holds, less the per-request records."""
    from loadgen.orchestrate import run_policies

    doc = run_policies(cell_args(cell), list(cell.policies), comparison=len(cell.policies) > 1, progress=False)
    out = {k: doc[k] for k in _KEEP if k in doc}
    out["command"] = "tandem " + ("loadgen compare" if cell.engine else "sim") + " " + " ".join(cell.argv)
    out["command"] += " --policies " + ",".join(cell.policies)
    if "runs" in doc:
        out["targets"] = {name: run["target"] for name, run in doc["runs"].items()}
    elif "target" in doc:
        out["targets"] = {cell.policies[0]: doc["target"]}
    return out


def run_repro(repro: Repro, out_dir: Path, *, quick: bool, engine: bool) -> Outcome:
    out_dir.mkdir(parents=True, exist_ok=True)
    outcome = Outcome()
    for cell in repro.cells(quick=quick, engine=engine):
        print(f"repro {repro.name}: {cell.name} ...", file=sys.stderr, flush=True)
        doc = run_cell(cell)
        (out_dir / f"{cell.name}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        outcome.docs[cell.name] = doc
    outcome.readme = readme(repro, outcome.docs, quick=quick)
    (out_dir / "README.md").write_text("\n".join(outcome.readme) + "\n")
    return outcome


def readme(repro: Repro, docs: dict[str, dict], *, quick: bool) -> list[str]:
    lines = [f"# {repro.title}", "", f"Regenerate: `tandem repro {repro.name}{' --quick' if quick else ''}`.", ""]
    if quick:
        lines += ["**Quick run** (short cells, one seed): a smoke test, not the comparison.", ""]
    notes = repro.setup_notes()
    if notes:
        lines += ["## Setup", "", *[f"- {n}" for n in notes], ""]
    rows = repro.paper_rows()
    if rows:
        lines += [
            "## The paper's figure beside ours",
            "",
            "| claim | paper | ours: "
            + " | ".join(sorted({_cell_suffix(n, r) for r in rows for n in docs if n.startswith(r.cell_prefix)}))
            + " |",
        ]
        cols = sorted({_cell_suffix(n, r) for r in rows for n in docs if n.startswith(r.cell_prefix)})
        lines.append("|---" * (len(cols) + 2) + "|")
        for r in rows:
            cells = []
            for c in cols:
                doc = docs.get(r.cell_prefix + c)
                cells.append(_fmt(ratio_over_seeds(doc, r), r.as_change) if doc else "—")
            lines.append(f"| {r.label} | {r.paper} | " + " | ".join(cells) + " |")
        lines += ["", "Ours: mean over seeds [min, max] of the paired per-seed ratio.", ""]
    if any("summary" in d and "rt" in d["summary"] for d in docs.values()):
        lines += [
            "## Cells (single runs)",
            "",
            "| cell | RT TTFT p99 ms | RT TPOT p50 ms | RT req/s |",
            "|---|---|---|---|",
        ]
        for name, d in docs.items():
            s = d["summary"].get("rt") if "rt" in d["summary"] else None
            if s:
                lines.append(
                    f"| {name} | {_ms(s.get('ttft_p99_s'))} | {_ms(s.get('tpot_p50_s'))} | "
                    f"{s.get('throughput_rps') or 0:.3f} |"
                )
        lines.append("")
    lines += repro.extra_readme(docs)
    missing = repro.not_implemented()
    if missing:
        lines += ["## Not implemented", "", *[f"- {m}" for m in missing], ""]
    lines += ["Each cell's JSON holds its command, config, summaries, ratios, seed spread and provenance."]
    return lines


def ratio_over_seeds(doc: dict, row: PaperRow) -> tuple[float, float, float] | None:
    """(mean, min, max) over seeds of policy/baseline for the row's metric (paired per seed)."""
    seeds = doc.get("seeds")
    if seeds:
        m = seeds["metrics"]
        a = m[row.policy][row.cls][row.metric]["values"]
        b = m[row.baseline][row.cls][row.metric]["values"]
        vals = [x / y for x, y in zip(a, b) if x is not None and y]
    else:
        s = doc["summary"]
        x, y = s[row.policy][row.cls].get(row.metric), s[row.baseline][row.cls].get(row.metric)
        vals = [x / y] if x is not None and y else []
    if not vals:
        return None
    return statistics.fmean(vals), min(vals), max(vals)


def _fmt(v: tuple[float, float, float] | None, as_change: bool) -> str:
    if v is None:
        return "n/a"
    if as_change:
        return f"{(v[0] - 1) * 100:+.1f}% [{(v[1] - 1) * 100:+.0f}, {(v[2] - 1) * 100:+.0f}]"
    return f"{v[0]:.2f}x [{v[1]:.2f}, {v[2]:.2f}]"


def _cell_suffix(name: str, row: PaperRow) -> str:
    return name[len(row.cell_prefix) :]


def _ms(v) -> str:
    return "n/a" if v is None else f"{v * 1e3:.0f}"
