"""Write a run's or a comparison's results: results.json, summary.md and PNG plots.

results.json: ``config``, ``summary`` (per class ``rt``/``be``/``all`` for one run; per
policy/mode name, then per class, for a comparison), ``ratios`` (comparisons: each name vs
the first), ``effective_throughput`` (when searched), ``requests`` (every request's record
with its derived metrics) and ``load`` (KV use and queue lengths over time).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadgen.driver import RunResult
from loadgen.metrics import CLASSES, ratio, request_row, summarize

# summary.md columns: (key, header, scale, format)
_COLUMNS = [
    ("requests", "requests", 1, "{:.0f}"),
    ("completed", "done", 1, "{:.0f}"),
    ("ttft_p50_s", "TTFT p50 ms", 1e3, "{:.0f}"),
    ("ttft_p99_s", "TTFT p99 ms", 1e3, "{:.0f}"),
    ("tpot_p50_s", "TPOT p50 ms", 1e3, "{:.1f}"),
    ("tbt_p99_s", "TBT p99 ms", 1e3, "{:.0f}"),
    ("normalized_latency_s", "norm. latency ms/tok", 1e3, "{:.1f}"),
    ("ttft_attainment", "TTFT att.", 100, "{:.1f}%"),
    ("tpot_attainment", "TPOT att.", 100, "{:.1f}%"),
    ("slo_attainment", "SLO att.", 100, "{:.1f}%"),
    ("throughput_rps", "req/s", 1, "{:.3f}"),
    ("output_tokens_per_s", "out tok/s", 1, "{:.1f}"),
]
_RATIO_KEYS = (
    "ttft_p50_s",
    "ttft_p99_s",
    "tbt_p99_s",
    "normalized_latency_s",
    "ttft_attainment",
    "tpot_attainment",
    "slo_attainment",
    "throughput_rps",
)


def run_document(result: RunResult, config: dict, effective: dict | None = None) -> dict:
    doc: dict[str, Any] = {
        "config": config,
        "target": result.target,
        "summary": summarize(result.records, result.elapsed_s),
    }
    if effective:
        doc["effective_throughput"] = effective
    doc["typing_hints"] = result.typing_hints
    doc["requests"] = [request_row(r) for r in result.records]
    doc["load"] = [vars(s) for s in result.load]
    return doc


def comparison_document(results: dict[str, RunResult], config: dict, effective: dict | None = None) -> dict:
    summaries = {name: summarize(r.records, r.elapsed_s) for name, r in results.items()}
    doc: dict[str, Any] = {"config": config, "summary": summaries, "ratios": ratios(summaries)}
    if effective:
        doc["effective_throughput"] = effective
    doc["runs"] = {
        name: {"target": r.target, "requests": [request_row(x) for x in r.records], "load": [vars(s) for s in r.load]}
        for name, r in results.items()
    }
    return doc


def ratios(summaries: dict[str, dict]) -> dict:
    """Each run's key metrics divided by the first run's (the baseline), per class."""
    names = list(summaries)
    if len(names) < 2:
        return {}
    base = summaries[names[0]]
    return {
        "baseline": names[0],
        **{
            name: {
                cls: {k: ratio(summaries[name][cls].get(k), base[cls].get(k)) for k in _RATIO_KEYS} for cls in CLASSES
            }
            for name in names[1:]
        },
    }


def write(out_dir: str | Path, doc: dict, *, title: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    (out / "summary.md").write_text(summary_markdown(doc, title))
    from loadgen import plots

    plots.write_all(out, doc)
    return out


def summary_markdown(doc: dict, title: str) -> str:
    summary = doc["summary"]
    runs = summary if "rt" not in summary else {"run": summary}
    lines = [f"# {title}", ""]
    if doc.get("provenance"):
        lines += [provenance_line(doc["provenance"]), ""]
    lines += ["```", json.dumps(doc.get("config", {}), default=_json_default), "```", ""]
    for cls in CLASSES:
        rows = {name: s[cls] for name, s in runs.items() if s[cls]["requests"]}
        if not rows:
            continue
        lines += [f"## {cls.upper()} requests", "", table(rows), ""]
    if doc.get("ratios"):
        lines += [_ratio_section(doc["ratios"])]
    if doc.get("seeds"):
        from loadgen.spread import spread_markdown

        lines += [spread_markdown(doc["seeds"])]
    if doc.get("effective_throughput"):
        lines += [_effective_section(doc["effective_throughput"])]
    lines += ["Plots: " + ", ".join(f"`{p}`" for p in ("ttft_cdf.png", "timeline.png", "attainment_vs_rate.png")), ""]
    return "\n".join(lines)


def provenance_line(prov: dict) -> str:
    """One line naming the code, host and software of a stamped result (loadgen/provenance.py)."""
    git, host = prov.get("git", {}), prov.get("host", {})
    cpu = host.get("cpu", {})
    commit = str(git.get("commit", "unknown"))[:7] + (" (dirty)" if git.get("dirty") is True else "")
    return (
        f"Measured at `{commit}` on {prov.get('timestamp_utc')}: {cpu.get('model')} "
        f"({cpu.get('isa', '?')}, {host.get('logical_cpus')} CPUs, load {prov.get('load_average')}), "
        f"torch {prov.get('versions', {}).get('torch')}, dtype {prov.get('dtype')}."
    )


def table(rows: dict[str, dict]) -> str:
    head = "| | " + " | ".join(h for _, h, _, _ in _COLUMNS) + " |"
    sep = "|---" * (len(_COLUMNS) + 1) + "|"
    body = [
        "| " + name + " | " + " | ".join(_cell(s.get(k), scale, fmt) for k, _, scale, fmt in _COLUMNS) + " |"
        for name, s in rows.items()
    ]
    return "\n".join([head, sep, *body])


def _cell(v, scale: float, fmt: str) -> str:
    return "n/a" if v is None else fmt.format(v * scale)


def _ratio_section(r: dict) -> str:
    base = r["baseline"]
    lines = [
        f"## Ratios vs {base} (RT unless noted)",
        "",
        "| | " + " | ".join(_RATIO_KEYS) + " | BE req/s |",
        "|---" * (len(_RATIO_KEYS) + 2) + "|",
    ]
    for name, per_cls in r.items():
        if name == "baseline":
            continue
        cells = [_fmt_ratio(per_cls["rt"].get(k)) for k in _RATIO_KEYS]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_fmt_ratio(per_cls['be'].get('throughput_rps'))} |")
    return "\n".join(lines) + "\n"


def _fmt_ratio(v) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _effective_section(eff: dict) -> str:
    lines = ["## Effective throughput", "", "| | rate (req/s) | target | bracketed | probes |", "|---|---|---|---|---|"]
    for name, e in eff.items():
        probes = ", ".join(f"{p['rate']:.2f}:{p['attainment']:.2f}" for p in e["probes"])
        lines.append(f"| {name} | {e['rate']:.3f} | {e['target']:.2f} | {e['bracketed']} | {probes} |")
    return "\n".join(lines) + "\n"


def _json_default(o):
    if hasattr(o, "__dict__"):
        return vars(o)
    return str(o)
