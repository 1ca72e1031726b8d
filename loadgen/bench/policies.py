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
    p.set_defaults(func=run, length_scale=0.25, slo_scale="auto", rate=1.0)


def run(args: argparse.Namespace) -> int:
    from loadgen import report
    from loadgen.orchestrate import run_policies

    policies = _policies(args.policies)
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
