"""Run a paper's cells and write `<out>/<cell>.json` plus `<out>/README.md`."""

from __future__ import annotations

import argparse
import fnmatch
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from loadgen.repro.base import Cell, Outcome, PaperRow, Repro

_KEEP = ("config", "summary", "ratios", "seeds", "effective_throughput", "profiles", "provenance")


def cell_args(cell: Cell) -> argparse.Namespace:
    from loadgen.cli import add_run_args

    p = argparse.ArgumentParser(prog=f"tandem {'loadgen compare' if cell.engine else 'sim'}")
    add_run_args(p, target_default="inproc" if cell.engine else "sim")
    return p.parse_args([*cell.argv, "--no-progress"])


def _ellm_sim(cell: Cell) -> dict:
    """`tandem bench ellm-sim`: its document as it is (it keeps no per-request records)."""
    from loadgen.bench import ellm_sim

    args = ellm_sim.parser().parse_args([*cell.argv, "--policies", ",".join(cell.policies)])
    return ellm_sim.measure(args, quiet=True)


def _hybrid(cell: Cell) -> dict:
    """`tandem bench hybrid`: the CPU engine's document as it is (per-run rows, no records)."""
    from loadgen.bench import hybrid

    return hybrid.measure(hybrid.parser().parse_args([*cell.argv, "--policies", ",".join(cell.policies)]))


BENCHES = {"ellm-sim": _ellm_sim, "hybrid": _hybrid}  # `Cell.bench` -> how to run it


def with_seeds(cell: Cell, seeds: int | None) -> Cell:
    """The cell with its `--seeds` value replaced (added when it has none); None: as it is."""
    if seeds is None:
        return cell
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    argv = list(cell.argv)
    if "--seeds" in argv:
        argv[argv.index("--seeds") + 1] = str(seeds)
    else:
        argv += ["--seeds", str(seeds)]
    return replace(cell, argv=tuple(argv))


def command_line(cell: Cell) -> str:
    """The cell as a `tandem` command a reader can run."""
    tool = f"bench {cell.bench}" if cell.bench else "loadgen compare" if cell.engine else "sim"
    return f"tandem {tool} {' '.join(cell.argv)} --policies {','.join(cell.policies)}"


def run_cell(cell: Cell) -> dict:
    """One cell's compact document: what results.json holds, less the per-request records."""
    from loadgen.orchestrate import run_policies

    if cell.bench is not None:
        if cell.bench not in BENCHES:
            raise ValueError(f"cell {cell.name}: unknown bench {cell.bench!r} (known: {sorted(BENCHES)})")
        return {**BENCHES[cell.bench](cell), "command": command_line(cell)}
    doc = run_policies(cell_args(cell), list(cell.policies), comparison=len(cell.policies) > 1, progress=False)
    out = {k: doc[k] for k in _KEEP if k in doc}
    out["command"] = command_line(cell)
    if "runs" in doc:
        out["targets"] = {name: run["target"] for name, run in doc["runs"].items()}
    elif "target" in doc:
        out["targets"] = {cell.policies[0]: doc["target"]}
    return out


def run_repro(
    repro: Repro,
    out_dir: Path,
    *,
    quick: bool,
    engine: bool,
    only: tuple[str, ...] = (),
    seeds: int | None = None,
    keep: bool = False,
) -> Outcome:
    """Run the repro's cells into `out_dir`. `only`: glob patterns on cell names (a paper's full
    grid can be hours; a subset is run and documented as such); `seeds`: replace each cell's
    `--seeds`; `keep`: a cell whose JSON is already in `out_dir` is read, not re-run, so a long
    grid can be run in parts (one process at a time) and the README covers every part."""
    out_dir.mkdir(parents=True, exist_ok=True)
    outcome = Outcome()
    for cell in repro.cells(quick=quick, engine=engine):
        path = out_dir / f"{cell.name}.json"
        if keep and path.exists():
            outcome.docs[cell.name] = json.loads(path.read_text())
            continue
        if only and not any(fnmatch.fnmatchcase(cell.name, pat) for pat in only):
            continue
        cell = with_seeds(cell, seeds)
        print(f"repro {repro.name}: {cell.name} ...", file=sys.stderr, flush=True)
        doc = run_cell(cell)
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
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
    lines += repro.figure(docs)
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
