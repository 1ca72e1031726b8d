"""PNG plots of a results document: TTFT CDF, latency over time with KV use, attainment vs rate."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_all(out: Path, doc: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    runs = _runs(doc)
    ttft_cdf(out / "ttft_cdf.png", runs)
    timeline(out / "timeline.png", runs)
    if doc.get("effective_throughput"):
        attainment_vs_rate(out / "attainment_vs_rate.png", doc["effective_throughput"])


def _runs(doc: dict) -> dict[str, dict]:
    if "runs" in doc:
        return doc["runs"]
    return {"run": {"requests": doc["requests"], "load": doc.get("load", [])}}


def ttft_cdf(path: Path, runs: dict[str, dict]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, run in runs.items():
        for cls, style in (("rt", "-"), ("be", ":")):
            v = np.sort([r["ttft_s"] for r in run["requests"] if r["req_class"] == cls and r["ttft_s"] is not None])
            if v.size:
                ax.plot(v, np.arange(1, v.size + 1) / v.size, style, label=f"{name} {cls.upper()}")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline(path: Path, runs: dict[str, dict]) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(7, 2.6 * len(runs)), squeeze=False, sharex=True)
    for ax, (name, run) in zip(axes[:, 0], runs.items()):
        rt = [r for r in run["requests"] if r["req_class"] == "rt" and r["ttft_s"] is not None]
        ax.scatter([r["arrival_s"] for r in rt], [r["ttft_s"] for r in rt], s=4, label="RT TTFT")
        done = [r for r in rt if r["e2e_s"] is not None]
        ax.scatter([r["arrival_s"] for r in done], [r["e2e_s"] for r in done], s=4, alpha=0.5, label="RT latency")
        ax.set_ylabel("seconds")
        ax.set_title(name, fontsize=9)
        load = run.get("load") or []
        if load:
            kv = ax.twinx()
            kv.plot([s["time_s"] for s in load], [s["kv_usage"] for s in load], "k-", lw=0.8, label="KV use")
            kv.set_ylim(0, 1.05)
            kv.set_ylabel("KV use")
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("arrival time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def attainment_vs_rate(path: Path, effective: dict[str, dict]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, e in effective.items():
        pts = sorted((p["rate"], p["attainment"]) for p in e["probes"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{name} (eff. {e['rate']:.2f} req/s)")
        target = e["target"]
    ax.axhline(target, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
