"""`tandem bench policies`: scheduling policies on identical arrivals, in-process engine.

Default workload ``rt-be`` (BROS's setup scaled to this CPU): RT Poisson arrivals with
ShareGPT-like lengths, a standing BE backlog with prompts U(512, 1024) and outputs
U(32, 128), every length times ``--length-scale`` (0.25), and the papers' SLOs (TTFT 0.4 s,
TPOT 0.2 s) times ``--slo-scale`` (``auto``: the ratio of this engine's measured decode step
to OPT-13B on an A100; see docs/loadgen.md). The JSON's ``summary`` holds one summary per
policy under its name (classes ``rt``, ``be``, ``all``); ``ratios`` divides each by the first.

A collapsed policy still yields numbers: arrivals stop at ``--duration``, RT requests in flight
drain for at most ``--drain-timeout`` seconds, and whatever is still open then is aborted
(`loadgen.driver`). ``unfinished`` counts those per policy and class, and the report says so
beside the latency figures, which are over *finished* requests only: a policy that left RT
requests unfinished looks better on latency than it was, so its ratio is a bound, not a value.

``--rounds N`` (N > 1) is for a busy host, whose load drifts over minutes: the policies run N
times, each round in the opposite order to the one before (fcfs,bros then bros,fcfs ...), so
neither policy always gets the later, or the earlier, minutes. The JSON then holds every
round (each run's summary, what it left unfinished, its wall time and the load average before
and after it) and ``rounds_ratios``: each key ratio per round with its median, min and max.
Per-request rows are left out of a rounds document (size); one round is the plain document.
(One rounds runner, `loadgen/bench/rounds.py`, serves this and `tandem bench ellm`, which
rotates its order instead.) Rounds need a fixed ``--slo-scale``: ``auto`` would measure the step again
on every run, and on a busy host every run would be judged against its own SLOs.
"""

from __future__ import annotations

import argparse
import sys

from loadgen.bench.common import write_json
from loadgen.cli import _policies, add_run_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "policies",
        help="scheduling policies on identical arrivals (in-process engine)",
        description=__doc__.split("\n\n")[0],
    )
    add_run_args(p, workload_default="rt-be", duration_default=60.0)
    p.add_argument("--policies", default="fcfs,rr,bros", help="comma-separated; the first is the baseline")
    p.add_argument("--json", dest="json_path", default=None, metavar="FILE", help="write the results document here")
    p.add_argument("--rounds", type=int, default=1, help="run the policies N times, alternating their order")
    p.set_defaults(func=run, length_scale=0.25, slo_scale="auto", rate=1.0)


def run(args: argparse.Namespace) -> int:
    from loadgen import report
    from loadgen.orchestrate import run_policies

    policies = _policies(args.policies)
    if args.rounds > 1:
        if str(args.slo_scale).lower() == "auto":  # measured per run: each run would get its own SLOs
            print("--rounds needs a fixed --slo-scale: 'auto' measures the step again on every run", file=sys.stderr)
            return 2
        return _run_rounds(args, policies)
    doc = run_policies(args, policies, comparison=True, progress=not args.no_progress and sys.stderr.isatty())
    doc["unfinished"] = unfinished(doc["summary"])
    title = f"tandem bench policies: {args.workload} on {args.target}"
    print(report.summary_markdown(doc, title))
    print(unfinished_markdown(doc["unfinished"]))
    write_json(doc, args.json_path)
    if args.out:
        report.write(args.out, doc, title=title)
    return 0


def unfinished(summary: dict[str, dict]) -> dict[str, dict[str, int]]:
    """Requests each policy left unfinished at the end of the drain, per class (rt, be)."""
    return {
        policy: {cls: int(per_cls[cls]["requests"] - per_cls[cls]["completed"]) for cls in ("rt", "be")}
        for policy, per_cls in summary.items()
    }


def unfinished_markdown(counts: dict[str, dict[str, int]]) -> str:
    """One line per policy; a warning where RT requests were cut off (latency over survivors)."""
    lines = ["## Unfinished at the end of the drain (aborted)", ""]
    for policy, c in counts.items():
        note = " -- RT latency is over the finished ones only: a lower bound" if c["rt"] else ""
        lines.append(f"- {policy}: RT {c['rt']}, BE {c['be']}{note}")
    return "\n".join(lines) + "\n"


# the ratios a rounds document aggregates: the trade-off BROS is judged by (docs/bros.md)
ROUND_RATIOS = (("rt", "normalized_latency_s"), ("rt", "ttft_attainment"), ("be", "throughput_rps"))


def _run_rounds(args: argparse.Namespace, policies: list[str]) -> int:
    """The rounds (`loadgen/bench/rounds.py`, shared with `tandem bench ellm`; every other round
    reversed) and their document: per round its order, each run and the ratios of that round."""
    from loadgen.bench.rounds import RoundRun, run_rounds
    from loadgen.orchestrate import run_policies
    from loadgen.report import ratios

    def run_one(policy: str) -> dict:
        return run_policies(args, [policy], comparison=True, progress=False)

    def progress(run: RoundRun) -> None:
        print(
            f"round {run.round + 1} {run.policy}: load {run.load_before[0]:.1f} -> {run.load_after[0]:.1f}", flush=True
        )

    rounds = []
    done = run_rounds(policies, args.rounds, run_one, "reverse", progress)
    stamp = done[0][0].result["provenance"]  # the first run's: the code checked out at the start
    for per_round in done:
        runs = {
            run.policy: {
                "summary": run.result["summary"][run.policy],
                "unfinished": unfinished(run.result["summary"])[run.policy],
                "wall_s": run.wall_s,
                "load_before": list(run.load_before),
                "load_after": list(run.load_after),
                "profile": (run.result.get("profiles") or {}).get(run.policy),  # what it planned from
            }
            for run in per_round
        }
        summaries = {p: runs[p]["summary"] for p in policies}
        rounds.append({"order": [run.policy for run in per_round], "runs": runs, "ratios": ratios(summaries)})
    out = {"config": {k: v for k, v in vars(args).items() if k != "func"}, "rounds": rounds}
    out["rounds_ratios"] = rounds_ratios(rounds, policies)
    out["provenance"] = stamp
    print(rounds_markdown(out["rounds_ratios"]))
    write_json(out, args.json_path)
    return 0


def rounds_ratios(rounds: list[dict], policies: list[str]) -> dict[str, dict]:
    """Per policy after the first: each `ROUND_RATIOS` ratio per round, with median, min, max."""
    import statistics

    out: dict[str, dict] = {}
    for policy in policies[1:]:
        for cls, key in ROUND_RATIOS:
            vals = [r["ratios"][policy][cls][key] for r in rounds]
            got = [v for v in vals if v is not None]
            out.setdefault(policy, {})[f"{cls}.{key}"] = {
                "per_round": vals,
                "median": statistics.median(got) if got else None,
                "min": min(got, default=None),
                "max": max(got, default=None),
            }
    return out


def rounds_markdown(agg: dict[str, dict]) -> str:
    lines = ["## Ratios vs the first policy, per round (median [min, max])", ""]
    for policy, metrics in agg.items():
        for name, m in metrics.items():
            shown = ", ".join("n/a" if v is None else f"{v:.3f}" for v in m["per_round"])
            lines.append(
                f"- {policy} {name}: {shown}" + (f" (median {m['median']:.3f})" if m["median"] is not None else "")
            )
    return "\n".join(lines) + "\n"
