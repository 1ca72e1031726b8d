"""`tandem bench ellm` (or `python -m loadgen.bench.ellm_ab`): `ellm` vs `fcfs` (vLLM-Recompute) vs `swap` (vLLM-Swap)
on the in-process CPU engine, in alternating rounds within one process, for a busy machine.

On a shared machine a policy's absolute throughput moves several-fold with the load, and in
`tandem bench policies` the policy run last in a process did worst (docs/ellm.md). So this
runs short rounds, each policy once per round on the same arrivals, the order rotated every
round (round i starts at policy i mod n; the rounds runner shared with `tandem bench policies
--rounds`, `loadgen/bench/rounds.py`), and reports per round each policy's figures, the
load average before and after its run (`os.getloadavg`), and its ratios to the baseline (the
first policy) *of the same round*: what can be read on a busy machine is the ratio, never the
absolute figure. Everything else is `tandem bench policies`'s arguments (`--target inproc`,
the workload, the pool, `--prefix-source`), parsed by that command's own parser; each run
builds its own engine, as there. The document keeps, per run, the RT summary, the engine's
counters and, for `ellm`, its `DecisionStats` and the cost model's meta (the measured
prefix-step fit and its points).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from loadgen.bench.rounds import RoundRun, run_rounds

# goodput and the attainments (loadgen/metrics.py): the issue asks for gains under the SLOs, not
# throughput alone; `slo_attainment` is TTFT and P99 TBT both met, unfinished requests missed
METRICS = (
    "output_tokens_per_s",
    "throughput_rps",
    "goodput_rps",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_attainment",
    "tpot_mean_attainment",
    "ttft_attainment",
    "slo_attainment",
    "completed",
)


def _run_args(argv: list[str]) -> argparse.Namespace:
    from services.cli import build_parser

    return build_parser().parse_args(["bench", "policies", *argv])


def run_one(args: argparse.Namespace, policy: str, scale) -> dict:
    """One policy's run: its RT summary, the engine's counters and (for `ellm`) decisions."""
    from loadgen.metrics import summarize
    from loadgen.orchestrate import run_once

    result = run_once(args, policy, scale, args.rate, False)
    rt = summarize(result.records, result.elapsed_s)["rt"]
    target = result.target or {}
    return {
        "elapsed_s": result.elapsed_s,
        "rt": {k: rt.get(k) for k in METRICS} | {"requests": len(result.records)},
        "engine_stats": target.get("engine_stats"),
        "policy_stats": target.get("policy_stats"),
        "cost_model_meta": target.get("cost_model_meta") if policy == "ellm" else None,
        "profile": target.get("cost_model_profile"),  # which profile it planned from (None: none)
    }


def ratios(rounds: list[list[dict]], baseline: str) -> dict[str, dict[str, list[float | None]]]:
    """Per policy and metric, its value over the baseline's in the same round, round by round."""
    out: dict[str, dict[str, list[float | None]]] = {}
    for runs in rounds:
        base = next(r for r in runs if r["policy"] == baseline)["rt"]
        for run in runs:
            per = out.setdefault(run["policy"], {k: [] for k in METRICS})
            for k in METRICS:
                a, b = run["rt"].get(k), base.get(k)
                per[k].append(a / b if a is not None and b else None)
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`tandem bench ellm`: the same bench with `tandem bench policies`'s arguments and
    defaults, `--rounds`, `--policies` and the document's path as `--json`."""
    from loadgen.cli import add_run_args

    p = sub.add_parser(
        "ellm",
        help="ellm vs fcfs vs swap on the in-process CPU engine in rotated rounds (busy-machine ratios)",
        description=__doc__.split("\n\n")[0],
    )
    add_run_args(p, workload_default="rt-be", duration_default=60.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--policies", default="fcfs,swap,ellm", help="comma-separated; the first is the baseline")
    p.add_argument("--json", dest="json_path", required=True, metavar="FILE", help="write the results document here")
    p.set_defaults(func=_run_cli, length_scale=0.25, slo_scale="auto", rate=1.0)


def _run_cli(args: argparse.Namespace) -> int:
    policies = [p for p in args.policies.split(",") if p]
    return measure(args, args.rounds, policies, args.json_path, "tandem bench ellm " + " ".join(sys.argv[2:]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", default="fcfs,swap,ellm", help="comma-separated; the first is the baseline")
    ap.add_argument("--out", required=True)
    ours, rest = ap.parse_known_args(argv)
    argv = argv if argv is not None else sys.argv[1:]
    policies = [p for p in ours.policies.split(",") if p]
    return measure(
        _run_args(rest), ours.rounds, policies, ours.out, "python -m loadgen.bench.ellm_ab " + " ".join(argv)
    )


def measure(args: argparse.Namespace, rounds_n: int, policies: list[str], out: str, command: str) -> int:
    """Run the rounds and write the document (module docstring) to `out`."""
    from loadgen.orchestrate import _SloScale
    from loadgen.provenance import decided_dtype, stamp

    provenance = stamp(
        dtype=decided_dtype(args.dtype), extra={"target": args.target}
    ).as_dict()  # the code checked out now
    scale = _SloScale(args)

    def record(run: RoundRun) -> dict:
        return {
            "policy": run.policy,
            "load_before": [round(x, 2) for x in run.load_before],
            "load_after": [round(x, 2) for x in run.load_after],
            **run.result,
            "round": run.round,
        }

    def progress(run: RoundRun) -> None:
        print(json.dumps({k: record(run)[k] for k in ("round", "policy", "load_before", "rt")}), flush=True)

    runs = run_rounds(policies, rounds_n, lambda policy: run_one(args, policy, scale), "rotate", progress)
    rounds = [[record(run) for run in per_round] for per_round in runs]
    table = ratios(rounds, policies[0])
    doc = {
        "command": command,
        "config": {**vars(args), "func": None, "rounds": rounds_n, "policies": policies},
        "rounds": rounds,
        "ratios_vs_first_per_round": table,
        "ratio_medians": {
            p: {k: statistics.median([v for v in vs if v is not None] or [float("nan")]) for k, vs in m.items()}
            for p, m in table.items()
        },
        "provenance": provenance,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(doc, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
