"""`python -m loadgen.sim.policy_trace`: what a policy did in one simulated run, step by step
summed up — batch sizes, HIDDEN rows and their share, preemptions (conversions included),
idle schedules with work waiting, the largest token gaps — beside its SLO attainment. It is
the "why" behind an effective-throughput number (docs/aptserve.md, docs/results.md).

One worker from a shipped or given profile, the ShareGPT workload at one Poisson rate, the
paper's SLO (TTFT <= 1 s, P99 TBT <= 1 s) unless told otherwise; every policy sees the same
arrivals. `--rho` overrides aptserve's ρ (a sensitivity check: the paper's code divides its
measured ρ by 5). Variants of `aptserve` by name: `aptserve-priced` (conversions priced,
`price_switches=True`), `aptserve-kv` (ρ = 1e9: HIDDEN never pays, "KV only") and
`aptserve-priced-kv` (both: only a preemption's re-prefill is priced), `aptserve-paper-hidden`
(HIDDEN offered by the paper's rule alone, also where the next decode iteration drops it),
`aptserve-paper-n` (that, and the penalty's N less the requests past their SLO, as the paper's
code), `aptserve-no-demotion` (decay 1: no SLO demotion), `aptserve-decay0.4` (the paper's
"Scheduling*": a late request keeps 0.4 of its value).
The recompute cost per step is the profile's price of each step's HIDDEN rebuild.
Writes one JSON document with the provenance stamp.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VARIANTS = {
    "aptserve-priced": ("aptserve", {"price_switches": True}),
    "aptserve-kv": ("aptserve", {"rho": 1e9}),
    "aptserve-priced-kv": ("aptserve", {"price_switches": True, "rho": 1e9}),
    "aptserve-paper-hidden": ("aptserve", {"withhold_dropped_hidden": False}),
    # the paper's code: HIDDEN by its rule alone, N less the requests past their SLO
    "aptserve-paper-n": ("aptserve", {"withhold_dropped_hidden": False, "penalty_counts_demoted": False}),
    "aptserve-no-demotion": ("aptserve", {"decay": 1.0}),  # a late request keeps its full value
    "aptserve-decay0.4": ("aptserve", {"decay": 0.4}),  # the paper's "Scheduling*" (its §6.6)
}


def trace(
    policy: str,
    rate: float,
    seed: int,
    duration: float,
    profile: str,
    rho: float | None,
    workload: str = "sharegpt",
    slo: tuple[float, float] = (1.0, 1.0),
    cv: float = 1.0,
    on_worker=None,
    max_num_seqs: int | None = None,
    num_blocks: int | None = None,
) -> dict:
    """One run; `on_worker(worker)` sees the simulated worker before the run (a recorder's
    hook, e.g. `apt_knapsack_trace`); `max_num_seqs` overrides the simulator's default and
    `num_blocks` the profile's KV pool (a memory-starved deployment: docs/aptserve.md, "When
    can HIDDEN pay")."""
    from engine.scheduling.request import SLO
    from loadgen.arrivals import ArrivalSpec
    from loadgen.driver import Driver
    from loadgen.factory import load_cost_model, worker_spec
    from loadgen.metrics import summarize, tbt_samples
    from loadgen.prompts import PromptBuilder
    from loadgen.sim.cluster import ClusterSpec, SimTarget
    from loadgen.sim.step_recorder import StepRecorder
    from loadgen.sim.worker import SimWorker
    from loadgen.workloads.build import WorkloadConfig, build_workload

    cost = load_cost_model(profile)
    none = argparse.Namespace(
        num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=None, max_model_len=None
    )
    spec = worker_spec(none, cost.meta)
    name, variant = VARIANTS.get(policy, (policy, {}))
    options = {"cost_model": cost, "default_slo": SLO(*slo)} if name == "aptserve" else {}
    if rho is not None and name == "aptserve":
        options["rho"] = rho
    options |= variant
    worker = SimWorker("w0", spec, cost, name, options)
    if on_worker is not None:
        on_worker(worker)
    recorder = StepRecorder(worker)
    cfg = WorkloadConfig(
        workload,
        ArrivalSpec("poisson", rate) if cv == 1.0 else ArrivalSpec("gamma", rate, cv),
        duration,
        seed=seed,
        slo_ttft_s=slo[0],
        slo_tpot_s=slo[1],
    )
    result = Driver(SimTarget([worker], ClusterSpec()), build_workload(cfg), PromptBuilder(spec.vocab_size, seed)).run()
    rt = summarize(result.records, result.elapsed_s)["rt"]
    gaps = sorted((g for r in result.records for g in tbt_samples(r)), reverse=True)
    return {
        "policy": policy,
        "rate": rate,
        "seed": seed,
        "slo_attainment": rt["slo_attainment"],
        "ttft_attainment": rt["ttft_attainment"],
        "tbt_p99_attainment": rt["tbt_p99_attainment"],
        "completed": rt["completed"],
        "output_tokens_per_s": rt["output_tokens_per_s"],
        **recorder.summary(),
        "largest_gaps_s": gaps[:5],
        "gaps_over_1s": sum(1 for g in gaps if g > 1.0),
        **preemption_profile(recorder.admitted, result.records),
    }


def preemption_profile(requests: list, records: list) -> dict:
    """Who is preempted and how often: the requests preempted at least once, the most times
    one request was, a histogram of counts, the preemptions falling on the largest quarter of
    requests (by prompt + output tokens), and the P99-TBT attainment of preempted vs never
    preempted requests (the churn that costs P99 TBT at high rates; docs/aptserve.md)."""
    from loadgen.metrics import tbt_p99

    counts = [r.num_preemptions for r in requests]
    total = sum(counts)
    sizes = sorted(len(r.prompt_token_ids) + r.params.max_tokens for r in requests)
    big = sizes[(3 * len(sizes)) // 4] if sizes else 0
    on_big = sum(r.num_preemptions for r in requests if len(r.prompt_token_ids) + r.params.max_tokens >= big)
    by_id = {r.request_id: r.num_preemptions for r in requests}
    # per group (preempted at least once, never): [records, completed, P99 TBT met among completed]
    group = {True: [0, 0, 0], False: [0, 0, 0]}
    for rec in records:
        cell = group[by_id.get(rec.request_id, 0) > 0]
        cell[0] += 1
        if rec.completed:
            p99 = tbt_p99(rec)
            cell[1] += 1
            cell[2] += p99 is None or rec.slo_tpot_s is None or p99 <= rec.slo_tpot_s
    hist: dict[str, int] = {}
    for c in counts:
        hist[str(c)] = hist.get(str(c), 0) + 1
    return {
        "requests": len(requests),
        "preempted_requests": sum(1 for c in counts if c),
        "max_preemptions_per_request": max(counts, default=0),
        "preemption_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "preemption_share_on_largest_quarter": on_big / total if total else 0.0,
        "completed_share_preempted": _ratio(group[True][1], group[True][0]),
        "completed_share_not_preempted": _ratio(group[False][1], group[False][0]),
        "tbt_p99_met_of_completed_preempted": _ratio(group[True][2], group[True][1]),
        "tbt_p99_met_of_completed_not_preempted": _ratio(group[False][2], group[False][1]),
    }


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--policies", default="fcfs,aptserve")
    ap.add_argument("--cost-model", default="opt-13b-a100-40gb")
    ap.add_argument(
        "--workload", default="sharegpt", help="a single-turn length profile (loadgen/workloads/datasets.py)"
    )
    ap.add_argument("--rho", type=float, default=None, help="aptserve's ρ override, s per block")
    ap.add_argument("--slo-ttft", type=float, default=1.0, help="TTFT target, s (the paper's Table 3)")
    ap.add_argument("--slo-tpot", type=float, default=1.0, help="P99 TBT target, s")
    ap.add_argument("--cv", type=float, default=1.0, help="Gamma arrivals' CV (1: Poisson; the paper's Table 4)")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV pool in blocks (default: the profile's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    runs = []
    for policy in args.policies.split(","):
        slo = (args.slo_ttft, args.slo_tpot)
        runs.append(
            trace(
                policy,
                args.rate,
                args.seed,
                args.duration,
                args.cost_model,
                args.rho,
                args.workload,
                slo,
                args.cv,
                num_blocks=args.num_blocks,
            )
        )
        print(json.dumps(runs[-1]), flush=True)
    if args.out:
        write_runs(args.out, vars(args), runs)
    return 0


def write_runs(out: str, config: dict, runs: list[dict]) -> None:
    """A trace command's document (this module's and `apt_knapsack_trace`'s): its config, its
    runs and the provenance stamp."""
    from loadgen.provenance import stamp

    doc = {"config": config, "runs": runs, "provenance": stamp().as_dict()}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
