"""BROS (hybrid RT + BE serving): Figs. 10-11's comparison, at our scale.

Simulator at paper scale: OPT-13B on the A100-40GB roofline profile, RT Poisson with ShareGPT
or LMSYS lengths at 1-3 req/s (one GPU; the paper's TP=2 pair reached 15 req/s, our knee is
correspondingly lower), a standing BE backlog (prompts U(512, 1024), outputs U(32, 128),
batches of 32), 10 minutes of arrivals, several seeds. Baselines: `fcfs-prefill-first` (the
papers' vLLM: unchunked, prefill-first), `fcfs` (today's vLLM, chunked), `swap` (vLLM with
swap preemption) and `rr` (the paper's round robin). The CPU engine at small scale (`--engine`):
the default model, float32, RT + BE at 0.5 and 1 req/s for 120 s.
"""

from __future__ import annotations

from loadgen.repro.base import Cell, PaperRow, Repro

POLICIES = ("fcfs-prefill-first", "fcfs", "swap", "rr", "bros")
_VLLM = "fcfs-prefill-first"


class BROSRepro(Repro):
    name = "bros"
    title = "BROS (Wan et al.): hybrid real-time and best-effort serving"

    def cells(self, *, quick: bool, engine: bool) -> list[Cell]:
        duration, seeds = ("60", "1") if quick else ("600", "3")
        rates = ("2",) if quick else ("1", "2", "3")
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

    def not_implemented(self) -> list[str]:
        return [
            "the 70B model and 15 req/s cells (Fig. 10c/f): no roofline profile for them",
            "TGI baseline (Fig. 12) and the KV ablation at RT 10 req/s on OPT-30B (Fig. 13)",
        ]

    def setup_notes(self) -> list[str]:
        return [
            "One A100-40GB per worker (the paper: OPT-13B with TP=2 on two), so rates are 1-3 req/s.",
            "Policies plan with a cost model fitted to a noisy simulated profile; steps carry 5% "
            "log-normal noise; every policy has 4 GiB of host swap (docs/simulator.md, Fairness).",
            "The paper's vLLM baseline is `fcfs-prefill-first`; chunked `fcfs` and `swap` are shown too.",
        ]
