"""The arithmetic and the table of `tandem bench compare`: pure functions on result records.

A comparison has rows (one result record each, `loadgen/bench/common.py: summarize`) in
rounds. Baseline rows belong to groups: the configurations of one system that compete for
"its best" (vLLM with its default binding and bound to every core) or a row that answers a
different question (llama.cpp on the parity weights, llama.cpp on the shipped Q4_1 file). Our
ratio against a group is taken against the group's best row in that round, so a baseline is
never judged by a configuration that happened to be weaker; the summary is the median of the
per-round ratios (each round's rows ran minutes apart at most, on one host).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

OURS = "tandem"
METRIC = "output_tokens_per_s"


@dataclass(frozen=True)
class Budgets:
    """The limits both sides run with, passed explicitly to every system and recorded."""

    kv_cache_gib: float
    max_num_seqs: int
    max_num_batched_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def round_order(rows: Sequence[str], round_index: int) -> list[str]:
    """The order rows run in round `round_index`: rotated by one each round, so no system always
    runs first or last on a machine whose load drifts. Round 0 starts with ours (it writes the
    prompts the others replay)."""
    if not rows:
        return []
    k = round_index % len(rows)
    return list(rows[k:]) + list(rows[:k])


def best_row(results: dict[str, dict | None], names: Sequence[str], metric: str = METRIC) -> str | None:
    """The row of `names` with the highest `metric` (None if none has a value)."""
    valued = [(results[n][metric], n) for n in names if results.get(n) and results[n].get(metric) is not None]
    return max(valued)[1] if valued else None


def ratios_against_best(
    results: dict[str, dict | None], groups: dict[str, Sequence[str]], metric: str = METRIC
) -> dict[str, dict[str, Any]]:
    """Per group: its best row and ours divided by that row's `metric` (None where undefined)."""
    ours = (results.get(OURS) or {}).get(metric)
    out = {}
    for group, names in groups.items():
        best = best_row(results, names, metric)
        theirs = results[best][metric] if best else None
        out[group] = {"best": best, "ratio": ours / theirs if ours and theirs else None}
    return out


def median(values: Sequence[float | None]) -> float | None:
    """The upper median of the defined values (a value that was measured, never an average)."""
    vals = sorted(v for v in values if v is not None)
    return vals[len(vals) // 2] if vals else None


def median_round(rounds: Sequence[dict], group: str) -> int:
    """Index of the round whose ratio against `group` is the median (the last round if none)."""
    ratios = [r["ratios"].get(group, {}).get("ratio") for r in rounds]
    mid = median(ratios)
    return ratios.index(mid) if mid is not None else len(rounds) - 1


def comparison_document(
    workload: dict[str, Any],
    budgets: Budgets,
    rows: Sequence[str],
    groups: dict[str, Sequence[str]],
    rounds: Sequence[dict],
    provenance: dict[str, Any],
) -> dict[str, Any]:
    """The JSON `tandem bench compare` writes. `rounds`: {"order", "results", "ratios"} each.

    ``primary_group`` (the first baseline group) picks the round the table shows; the per-group
    medians are over all rounds. ``same_host`` is False unless every row's provenance names one
    host (results from different machines are not compared).
    """
    from loadgen.provenance import same_host

    primary = next(iter(groups), None)
    stamps = [res.get("provenance") if res else None for r in rounds for res in r["results"].values()]
    return {
        "workload": dict(workload),
        "budgets": budgets.as_dict(),
        "rows": list(rows),
        "groups": {g: list(names) for g, names in groups.items()},
        "primary_group": primary,
        "rounds": list(rounds),
        "ratio_medians": {g: median([r["ratios"][g]["ratio"] for r in rounds]) for g in groups},
        "median_round": median_round(rounds, primary) if primary else len(rounds) - 1,
        "same_host": same_host(*stamps),
        "provenance": provenance,
    }


def _fmt(v: Any, scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if v is None else f"{v * scale:,.1f}{unit}" if abs(v * scale) >= 10 else f"{v * scale:,.2f}{unit}"


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def format_comparison(result: dict) -> str:
    """The table of the median round: one line per row, ours divided by each row's throughput."""
    shown = result["rounds"][result["median_round"]]
    res = shown["results"]
    ours = (res.get(OURS) or {}).get(METRIC)
    cols = ("row", "output tok/s", "elapsed", "TTFT p50", "TTFT p99", "peak RSS", "tandem / row")
    lines = [cols]
    for name in result["rows"]:
        r = res.get(name) or {}
        tps = r.get(METRIC)
        ratio = "" if name == OURS else _fmt_ratio(ours / tps if ours and tps else None)
        lines.append(
            (
                name,
                _fmt(tps),
                _fmt(r.get("elapsed_s"), unit=" s"),
                _fmt(r.get("ttft_p50_s"), 1000.0, " ms"),
                _fmt(r.get("ttft_p99_s"), 1000.0, " ms"),
                _fmt(r.get("peak_rss_gib"), unit=" GiB"),
                ratio,
            )
        )
    w = [max(len(row[i]) for row in lines) for i in range(len(cols))]
    wl, b = result["workload"], result["budgets"]
    head = [
        f"workload: {wl['num_prompts']} prompts, input U[{wl['input_len'][0]},{wl['input_len'][1]}], "
        f"output {wl['output_len']} (ignore_eos, greedy), {wl['dtype']}; budgets: KV {b['kv_cache_gib']} GiB, "
        f"max_num_seqs {b['max_num_seqs']}, max_num_batched_tokens {b['max_num_batched_tokens']}",
        f"round {result['median_round'] + 1} of {len(result['rounds'])} (the median by ratio against "
        f"{result['primary_group']})",
    ]
    body = ["  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(row)) for row in lines]
    tail = [
        f"tandem / best {g}: per round "
        + ", ".join(_fmt_ratio(r["ratios"][g]["ratio"]) for r in result["rounds"])
        + f"; median {_fmt_ratio(result['ratio_medians'][g])}"
        for g in result["groups"]
    ]
    if not result.get("same_host", True):
        tail.append("WARNING: the rows' provenance names different hosts; these ratios compare nothing")
    return "\n".join(head + body + tail)
