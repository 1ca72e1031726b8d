"""The rounds and the summary of `tandem bench hybrid` (`hybrid.py` runs them): the order in which
every policy runs on every (rate, seed), and per rate and policy the mean and range over seeds,
the paired per-seed ratios to the baseline and the highest tested rate meeting each attainment
level. Pure functions over the run rows, so the summary is tested without an engine."""

from __future__ import annotations

import statistics


def rounds(policies: list[str], rates: list[float], seeds: list[int]) -> list[tuple[float, int, str]]:
    """(rate, seed, policy) in run order: every policy once per (rate, seed), the order rotating
    from one (rate, seed) to the next (alternating rounds for two policies)."""
    out = []
    for i, (rate, seed) in enumerate((r, s) for r in rates for s in seeds):
        k = i % len(policies)
        out += [(rate, seed, p) for p in policies[k:] + policies[:k]]
    return out


SUMMARY_KEYS = (
    "slo_attainment",
    "ttft_attainment",
    "tbt_p99_attainment",
    "goodput_rps",
    "mean_decode_batch",
    "max_batch",
    "preemptions",
    "conversions",
    "hidden_row_share",
    "mean_step_s",
)


def summarize_runs(runs: list[dict], policies: list[str], levels=(0.9, 0.6)) -> dict:
    """Per rate and policy: mean [min, max] over seeds of `SUMMARY_KEYS`; paired per-seed ratios
    to the first policy; and per policy and seed the highest tested rate meeting each level."""
    base = policies[0]
    by = {(r["rate"], r["seed"], r["policy"]): r for r in runs}
    rates = sorted({r["rate"] for r in runs})
    seeds = sorted({r["seed"] for r in runs})
    per_rate = {}
    for rate in rates:
        entry = {}
        for p in policies:
            rs = [by[(rate, s, p)] for s in seeds if (rate, s, p) in by]
            entry[p] = {k: _spread([r[k] for r in rs if r.get(k) is not None]) for k in SUMMARY_KEYS}
            if p != base:
                pairs = [
                    (by[(rate, s, p)], by[(rate, s, base)])
                    for s in seeds
                    if (rate, s, p) in by and (rate, s, base) in by
                ]
                entry[p]["ratio_to_" + base] = {
                    k: _spread([a[k] / b[k] for a, b in pairs if b.get(k)])
                    for k in ("slo_attainment", "goodput_rps", "mean_decode_batch")
                }
        per_rate[str(rate)] = entry
    effective = {
        str(level): {
            p: {
                str(s): max(
                    (rate for rate in rates if by.get((rate, s, p), {}).get("slo_attainment", -1) >= level),
                    default=None,
                )
                for s in seeds
            }
            for p in policies
        }
        for level in levels
    }
    return {"per_rate": per_rate, "effective_rate_tested": effective}


def _spread(values: list[float]) -> dict | None:
    return (
        {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)} if values else None
    )
