"""`python -m loadgen.sim.probe_trace`: one probe of an effective-throughput cell, step by step.

A repro cell's rate search (`tandem sim --find-rate`) keeps only each probe's attainment. This
runs probes again exactly as the search ran them (the cell's own `tandem sim` options: the
fitted planning model, step noise, host swap, `max_num_seqs`, the drain, the seed and so the
same arrivals; `loadgen.orchestrate.run_once`), at the rates asked, served to the end (no early
stop: the statistics are over the whole probe), with a `StepRecorder` on the simulated worker.
Per (policy, rate): SLO / TTFT / P99-TBT attainment, how the misses split (TTFT only, P99 TBT
only, both), batch sizes, HIDDEN rows and their share, the K/V rebuild (recompute) seconds per
step and their share of busy time, time at the memory limit, preemptions and who took them.
It is the "why" behind a cell's ratio (docs/aptserve.md, "The paper's workload (eleventh
session)"). Writes one JSON document with the provenance stamp.

    python -m loadgen.sim.probe_trace --cell sim-opt-att0.6-seed0 --rates 2.5,12 \\
        --policies fcfs-prefill-first,aptserve --out docs/results/aptserve/sim11/why/x.json
"""

from __future__ import annotations

import argparse
import json
import sys


def cell_argv(repro: str, cell: str) -> tuple[str, ...]:
    """The cell's `tandem sim` options (its full-grid definition), less the rate search."""
    from loadgen.repro.registry import REPROS

    cells = {c.name: c for c in REPROS[repro].cells(quick=False, engine=False)}
    if cell not in cells:
        raise SystemExit(f"unknown cell {cell!r} of {repro}: {sorted(cells)}")
    argv = list(cells[cell].argv)
    # one probe, not a search: the search's own options go; the rest is the probe's setup
    for flag in ("--find-rate", "--decide-early"):
        if flag in argv:
            argv.remove(flag)
    if "--attainment" in argv:
        i = argv.index("--attainment")
        del argv[i : i + 2]
    return tuple(argv)


def probe(argv: tuple[str, ...], policy: str, rate: float, requests: int | None = None) -> dict:
    """One probe of `policy` at `rate` with the cell's options, recorded step by step;
    `requests`: another trace size (a longer trace asks whether a rate is sustained)."""
    from loadgen.cli import add_run_args
    from loadgen.metrics import summarize, tbt_samples
    from loadgen.orchestrate import _SloScale, run_once
    from loadgen.sim.policy_trace import preemption_profile
    from loadgen.sim.step_recorder import StepRecorder

    p = argparse.ArgumentParser()
    add_run_args(p, target_default="sim")
    args = p.parse_args([*argv, "--no-progress", *(("--requests", str(requests)) if requests else ())])
    recorders: list[StepRecorder] = []

    def attach(target) -> None:
        recorders.extend(StepRecorder(w) for w in target.workers.values())

    result = run_once(args, policy, _SloScale(args), rate, progress=False, on_target=attach)
    (recorder,) = recorders  # the paper's setup is one worker
    rt = summarize(result.records, result.elapsed_s)["rt"]
    misses, stalled_but_met = miss_split(result.records)
    return {
        "policy": policy,
        "rate": rate,
        "slo_attainment": rt["slo_attainment"],
        "ttft_attainment": rt["ttft_attainment"],
        "tbt_p99_attainment": rt["tbt_p99_attainment"],
        "requests": rt["requests"],
        "completed": rt["completed"],
        "misses": misses,
        "met_with_a_gap_over_tbt_slo": stalled_but_met,
        "largest_gap_s": max((g for r in result.records for g in tbt_samples(r)), default=None),
        "ttft_p50_s": rt["ttft_p50_s"],
        "tpot_p50_s": rt["tpot_p50_s"],
        "output_tokens_per_s": rt["output_tokens_per_s"],
        "elapsed_s": result.elapsed_s,
        **recorder.summary(),
        **preemption_profile(recorder.admitted, result.records),
    }


def miss_split(records) -> tuple[dict, int]:
    """How the SLO misses split, by the metrics' own tests (the SLO is TTFT and P99 TBT both
    met), and how many met requests had a gap over the TBT target all the same."""
    from loadgen.metrics import tbt_ok, tbt_samples, ttft_ok

    misses = {"ttft_only": 0, "tbt_only": 0, "both": 0, "not_completed": 0}
    stalled_but_met = 0
    for rec in records:
        if rec.slo_ttft_s is None and rec.slo_tpot_s is None:
            continue
        if not rec.completed:
            misses["not_completed"] += 1
            continue
        late, choppy = not ttft_ok(rec), not tbt_ok(rec)
        if late or choppy:
            misses["both" if late and choppy else "ttft_only" if late else "tbt_only"] += 1
        elif rec.slo_tpot_s is not None and max(tbt_samples(rec), default=0.0) > rec.slo_tpot_s:
            # met, though a gap exceeded the TBT target: the per-request P99 (the paper's metric)
            # leaves out a request's largest ~1% of gaps, so a preempted request that waited
            # minutes once and then decoded at speed still counts as met
            stalled_but_met += 1
    return misses, stalled_but_met


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repro", default="aptserve")
    ap.add_argument("--cell", required=True, help="a cell of the repro's full grid, e.g. sim-opt-att0.6-seed0")
    ap.add_argument("--rates", required=True, help="comma-separated req/s")
    ap.add_argument("--policies", default=None, help="default: the cell's")
    ap.add_argument("--requests", type=int, default=None, help="another trace size than the cell's")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from loadgen.provenance import stamp

    stamped = stamp().as_dict()  # at the start: the code that runs is the code checked out now
    cell_opts = cell_argv(args.repro, args.cell)
    if args.policies:
        policies = args.policies.split(",")
    else:
        from loadgen.repro.registry import REPROS

        policies = next(c for c in REPROS[args.repro].cells(quick=False, engine=False) if c.name == args.cell).policies
    runs = []
    for rate in (float(r) for r in args.rates.split(",")):
        for policy in policies:
            runs.append(probe(cell_opts, policy, rate, args.requests))
            print(json.dumps({k: v for k, v in runs[-1].items() if not isinstance(v, dict)}), flush=True)
    if args.out:
        from pathlib import Path

        config = {**vars(args), "cell_argv": list(cell_opts), "policies": list(policies)}
        doc = {"config": config, "runs": runs, "provenance": stamped}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
