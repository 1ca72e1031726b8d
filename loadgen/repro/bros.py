"""BROS (hybrid RT + BE serving): Figs. 10-11's comparison, at our scale.

Simulator at paper scale: OPT-13B on the A100-40GB roofline profile, RT Poisson with ShareGPT
or LMSYS lengths at 2, 2.5 and 3 req/s, a standing BE backlog (prompts U(512, 1024), outputs U(32, 128),
batches of 32), 10 minutes of arrivals, several seeds. Baselines: `fcfs-prefill-first` (the
papers' vLLM: unchunked, prefill-first), `fcfs` (today's vLLM, chunked), `swap` (vLLM with
swap preemption) and `rr` (the paper's round robin). The CPU engine at small scale (`--engine`):
the default model, float32, RT + BE at 0.5 and 1 req/s for 120 s.

Which rates are "the paper's loads" (docs/bros.md, "Is the baseline in the paper's regime?"):
the paper's figure gives no rate axis in its text (one GPU pair here vs its TP=2 pair, so its
rates do not carry over), but it states where its vLLM was: TTFT attainment 1.28% averaged over
15 cells, 0 in 8 of them, so no cell above 19.2%. Our `fcfs-prefill-first` is at 19.9% at
1 req/s (lighter than every paper cell), 3.2% at 2 and 0.3% at 3: the grid is the rates where
the baseline queues as the paper's did, and `figure` prints the baseline's attainments beside
the paper's so every run shows which regime it measured.
"""

from __future__ import annotations

from loadgen.repro.base import Cell, PaperRow, Repro

POLICIES = ("fcfs-prefill-first", "fcfs", "swap", "rr", "bros")
_VLLM = "fcfs-prefill-first"
# RT req/s where our vLLM baseline's TTFT attainment is in the paper's range (module docstring)
PAPER_REGIME_RATES = ("2", "2.5", "3")
# [paper] §7.2.2: vLLM's mean TTFT attainment over its 15 cells; its TPOT attainment is not
# stated, only BROS's (65.49% ShareGPT, 75.38% LMSYS) and BROS/vLLM (1.73x, 2.62x), so the
# implied vLLM figure is their quotient (an estimate: the factors may be means of per-cell ratios)
PAPER_VLLM_TTFT_ATTAINMENT = 0.0128
PAPER_VLLM_TPOT_ATTAINMENT = {"sharegpt": 0.6549 / 1.73, "lmsys": 0.7538 / 2.62}


class BROSRepro(Repro):
    name = "bros"
    title = "BROS (Wan et al.): hybrid real-time and best-effort serving"

    def cells(self, *, quick: bool, engine: bool) -> list[Cell]:
        duration, seeds = ("60", "1") if quick else ("600", "3")
        rates = ("2",) if quick else PAPER_REGIME_RATES
        out = [
            Cell(
                f"sim-{profile}-r{rate}",
                (
                    "--workload",
                    "rt-be",
                    "--rt-profile",
                    profile,
                    "--rate",
                    rate,
                    "--duration",
                    duration,
                    "--be-batch",
                    "32",
                    "--seeds",
                    seeds,
                    "--cost-model",
                    "opt-13b-a100-40gb",
                ),
                POLICIES,
            )
            for profile in ("sharegpt", "lmsys")
            for rate in rates
        ]
        if engine:
            out += [
                Cell(
                    f"engine-cpu-r{rate}",
                    (
                        "--target",
                        "inproc",
                        "--workload",
                        "rt-be",
                        "--rate",
                        rate,
                        "--duration",
                        "120",
                        "--dtype",
                        "float32",
                        "--slo-scale",
                        "auto",
                        "--be-batch",
                        "16",
                    ),
                    ("fcfs", "bros"),
                    engine=True,
                )
                for rate in ("0.5", "1")
            ]
        return out

    def paper_rows(self) -> list[PaperRow]:
        rows = []
        stated = {  # [paper] §7.2, Figs. 10-11 (bros-notes.md §4.1): vs vLLM, vs RR
            "sharegpt": {
                "lat": ("-74.20%", "-54.31%"),
                "be": ("-11.29%", "-8.80%"),
                "ttft": ("36.38x", "11.75x"),
                "tpot": ("1.73x", "1.47x"),
            },
            "lmsys": {
                "lat": ("-69.61%", "-25.77%"),
                "be": ("-17.67%", "-15.18%"),
                "ttft": ("21.42x", "14.23x"),
                "tpot": ("2.62x", "2.28x"),
            },
        }
        for profile, s in stated.items():
            for i, base in enumerate((_VLLM, "rr")):
                vs = "vLLM" if i == 0 else "RR"
                prefix = f"sim-{profile}-"
                rows += [
                    PaperRow(
                        f"{profile}: RT normalised latency vs {vs}",
                        s["lat"][i],
                        prefix,
                        "bros",
                        base,
                        "rt",
                        "normalized_latency_s",
                    ),
                    PaperRow(
                        f"{profile}: BE throughput vs {vs}", s["be"][i], prefix, "bros", base, "be", "throughput_rps"
                    ),
                    PaperRow(
                        f"{profile}: TTFT attainment vs {vs}",
                        s["ttft"][i],
                        prefix,
                        "bros",
                        base,
                        "rt",
                        "ttft_attainment",
                        as_change=False,
                    ),
                    PaperRow(
                        f"{profile}: TPOT attainment vs {vs}",
                        s["tpot"][i],
                        prefix,
                        "bros",
                        base,
                        "rt",
                        "tpot_attainment",
                        as_change=False,
                    ),
                ]
        return rows

    def figure(self, docs: dict[str, dict]) -> list[str]:
        """The baseline's own regime per simulator cell beside the paper's vLLM: a ratio is only
        comparable to the paper's where the baseline queues as the paper's did."""
        rows = []
        for name, doc in docs.items():
            profile = next((p for p in PAPER_VLLM_TPOT_ATTAINMENT if name.startswith(f"sim-{p}-")), None)
            if profile is None or _VLLM not in doc.get("summary", {}):
                continue
            ttft, tpot, lat = (
                baseline_metric(doc, m) for m in ("ttft_attainment", "tpot_attainment", "normalized_latency_s")
            )
            rows.append(
                f"| {name} | {_pct(ttft)} | {_pct(tpot)} | "
                f"{'n/a' if lat is None else f'{lat[0] * 1e3:.0f}'} | "
                f"{PAPER_VLLM_TTFT_ATTAINMENT:.2%} | {PAPER_VLLM_TPOT_ATTAINMENT[profile]:.0%} |"
            )
        if not rows:
            return []
        return [
            "## The baseline's regime beside the paper's vLLM",
            "",
            f"| cell | {_VLLM} TTFT attainment | TPOT attainment | RT normalised latency ms/token "
            "| paper's vLLM TTFT attainment (mean of 15 cells) | paper's vLLM TPOT attainment (implied) |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            "Ours: mean over seeds [min, max]. The paper's vLLM missed every TTFT SLO in 8 of its 15 "
            "cells, so no cell of its was above 19.2%.",
            "",
        ]

    def not_implemented(self) -> list[str]:
        return [
            "the 70B model and 15 req/s cells (Fig. 10c/f): no roofline profile for them",
            "TGI baseline (Fig. 12) and the KV ablation at RT 10 req/s on OPT-30B (Fig. 13)",
        ]

    def setup_notes(self) -> list[str]:
        return [
            "One A100-40GB per worker (the paper: OPT-13B with TP=2 on two); rates are where our vLLM "
            "baseline's TTFT attainment is in the paper's range (table below), not the paper's req/s.",
            "Policies plan with a cost model fitted to a noisy simulated profile; steps carry 5% "
            "log-normal noise; every policy has 4 GiB of host swap (docs/simulator.md, Fairness).",
            "The paper's vLLM baseline is `fcfs-prefill-first`; chunked `fcfs` and `swap` are shown too.",
        ]


def baseline_metric(doc: dict, metric: str) -> tuple[float, float, float] | None:
    """(mean, min, max) over seeds of the vLLM baseline's RT `metric` (one value without seeds)."""
    seeds = doc.get("seeds")
    if seeds:
        vals = [v for v in seeds["metrics"][_VLLM]["rt"][metric]["values"] if v is not None]
    else:
        v = doc["summary"][_VLLM]["rt"].get(metric)
        vals = [] if v is None else [v]
    return (sum(vals) / len(vals), min(vals), max(vals)) if vals else None


def _pct(v: tuple[float, float, float] | None) -> str:
    return "n/a" if v is None else f"{v[0]:.1%} [{v[1]:.1%}, {v[2]:.1%}]"
