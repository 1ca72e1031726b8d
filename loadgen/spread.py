"""Several seeds of one comparison: each metric's spread, and each ratio's.

One seed's Poisson arrivals and lengths can favour one policy by chance (a burst of long RT
prompts right behind a BE batch); a ratio quoted without its spread over seeds hides that.
`seed_spread` takes the per-seed summaries (`metrics.summarize` per policy) and gives, per
policy and class, the mean, min, max and standard deviation of every summary metric, and per
non-baseline policy the same for its ratios to the baseline of the *same seed* (paired: the
two saw identical arrivals).
"""

from __future__ import annotations

import statistics

from loadgen.metrics import CLASSES, ratio

METRICS = (
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_mean_s",  # the Symphony paper's latency axis (`repro symphony`)
    "tbt_p99_s",
    "normalized_latency_s",
    "ttft_attainment",
    "tpot_attainment",
    "slo_attainment",
    "throughput_rps",
)


def stats(values: list[float | None]) -> dict:
    """mean/min/max/stdev of the defined values (None where no seed had one)."""
    vs = [v for v in values if v is not None]
    if not vs:
        return {"mean": None, "min": None, "max": None, "stdev": None, "n": 0, "values": values}
    return {
        "mean": statistics.fmean(vs),
        "min": min(vs),
        "max": max(vs),
        "stdev": statistics.stdev(vs) if len(vs) > 1 else 0.0,
        "n": len(vs),
        "values": values,
    }


def seed_spread(seeds: list[int], per_seed: dict[str, list[dict]]) -> dict:
    """`per_seed[policy][i]`: that policy's summary at `seeds[i]`; the first policy is the baseline."""
    names = list(per_seed)
    base = names[0]
    out: dict = {"seeds": seeds, "baseline": base, "metrics": {}, "ratios": {}}
    for name in names:
        out["metrics"][name] = {
            cls: {k: stats([s[cls].get(k) for s in per_seed[name]]) for k in METRICS} for cls in CLASSES
        }
    for name in names[1:]:
        pairs = list(zip(per_seed[name], per_seed[base], strict=True))
        out["ratios"][name] = {
            cls: {k: stats([ratio(s[cls].get(k), b[cls].get(k)) for s, b in pairs]) for k in METRICS} for cls in CLASSES
        }
    return out


def spread_markdown(spread: dict) -> str:
    """The headline ratios (RT normalised latency, TTFT attainment, BE throughput) over seeds."""
    n = len(spread["seeds"])
    lines = [
        f"## Over {n} seeds ({', '.join(map(str, spread['seeds']))}): ratio vs {spread['baseline']}, mean [min, max]",
        "",
        "| | RT norm. latency | RT TTFT att. | RT SLO att. | BE req/s |",
        "|---|---|---|---|---|",
    ]
    for name, r in spread["ratios"].items():
        cells = [
            _cell(r["rt"]["normalized_latency_s"]),
            _cell(r["rt"]["ttft_attainment"]),
            _cell(r["rt"]["slo_attainment"]),
            _cell(r["be"]["throughput_rps"]),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(s: dict) -> str:
    if s["mean"] is None:
        return "n/a"
    return f"{s['mean']:.2f}x [{s['min']:.2f}, {s['max']:.2f}]"
