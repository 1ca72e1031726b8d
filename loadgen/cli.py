"""`tandem loadgen run|compare` and `tandem sim`: drive a workload against a target, write a report.

Targets: ``inproc`` (the engine in this process), ``sim`` (the discrete-event simulator) or
``http://HOST:PORT`` (a running gateway). ``compare`` (and ``tandem sim --policies``) runs
several scheduling policies on identical arrivals and tabulates the ratios.
"""

from __future__ import annotations

import argparse
import sys

from loadgen.factory import DEFAULT_SIM_PROFILE, PROFILE_DIR
from loadgen.workloads.build import WORKLOADS
from shared.engine_options import add_aptserve_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "loadgen", help="load generator: SLO metrics, reports, policy comparisons", description=__doc__.split("\n\n")[0]
    )
    lsub = p.add_subparsers(dest="loadgen_command", metavar="CMD")
    lsub.required = True
    run = lsub.add_parser("run", help="one run against a target")
    add_run_args(run)
    run.add_argument("--policy", default="fcfs", help="scheduling policy (inproc, sim)")
    run.set_defaults(func=cmd_run)
    cmp_ = lsub.add_parser("compare", help="several policies on identical arrivals")
    add_run_args(cmp_)
    cmp_.add_argument("--policies", default="fcfs,rr", help="comma-separated policies; the first is the baseline")
    cmp_.set_defaults(func=cmd_compare)

    s = sub.add_parser(
        "sim",
        help="cluster simulator: the real scheduler and KV manager, modelled step times",
        description="Discrete-event simulation (see docs/simulator.md). "
        "Same options as `tandem loadgen run --target sim`.",
    )
    add_run_args(s, target_default="sim")
    s.add_argument("--policies", default="fcfs", help="comma-separated policies (more than one: a comparison)")
    s.set_defaults(func=cmd_sim)


def _shipped_profiles() -> list[str]:
    """The names `--cost-model` accepts besides a file: read from the directory, so the help
    cannot fall behind the profiles shipped (it once listed two of four)."""
    return sorted(f.stem for f in PROFILE_DIR.glob("*.json"))


def add_run_args(
    p: argparse.ArgumentParser,
    *,
    target_default: str = "inproc",
    workload_default: str = "sharegpt",
    duration_default: float = 60.0,
) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--target", default=target_default, help="inproc | sim | http://HOST:PORT")
    g.add_argument("--workload", default=workload_default, choices=WORKLOADS)
    g.add_argument("--rate", type=float, default=1.0, help="requests (sessions) per second")
    g.add_argument("--duration", type=float, default=duration_default, help="seconds of arrivals")
    g.add_argument(
        "--requests",
        type=int,
        default=None,
        help="open-loop arrivals: a window of this many expected requests at each rate (duration = N / rate, "
        "as the papers' traces of N sampled requests; --find-rate probes then differ in length); overrides --duration",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", default=None, metavar="DIR", help="write results.json, summary.md and plots here")
    g.add_argument("--arrival", default="poisson", choices=["poisson", "gamma", "trace", "closed"])
    g.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation")
    g.add_argument("--trace", default=None, metavar="FILE", help="trace arrivals: timestamps file")
    g.add_argument("--users", type=int, default=0, help="closed loop: concurrent users")
    g.add_argument("--dataset", default=None, metavar="FILE", help="jsonl workload: the dataset")
    g.add_argument("--rt-profile", default="sharegpt", help="RT lengths for sessions and rt-be")
    g.add_argument("--length-scale", type=float, default=1.0, help="multiply every token length")
    g.add_argument("--slo-scale", default="1", help="multiply the papers' SLOs (a number, or 'auto')")
    g.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in s (overrides, after scaling)")
    g.add_argument("--slo-tpot", type=float, default=None, help="TPOT / P99 TBT SLO in s (overrides)")
    g.add_argument("--be-batch", type=int, default=0, help="standing BE backlog batch size (rt-be, be: 16)")
    g.add_argument("--be-refill", default="batch", choices=["batch", "each"])
    g.add_argument("--turns-mean", type=float, default=4.0, help="sessions: mean turns")
    g.add_argument("--reading-wpm", type=float, default=250.0)
    g.add_argument("--typing-wpm", type=float, default=40.0)
    g.add_argument(
        "--users-ramp-s",
        type=float,
        default=0.0,
        help="closed-loop sessions: users start at uniform offsets over this many seconds (default: all at 0)",
    )
    g.add_argument(
        "--warmup-s",
        type=float,
        default=0.0,
        help="measure only requests arriving after this many seconds (closed-loop sessions start every "
        "user on a fresh conversation: the warm-up has short histories; docs/sessions.md)",
    )
    g.add_argument("--drain-timeout", type=float, default=None, help="s to wait for RT after the window")
    g.add_argument("--attainment", type=float, default=0.9, help="target for --find-rate")
    g.add_argument(
        "--find-rate",
        action="store_true",
        help="bisect the request rate for the effective throughput (attainment >= --attainment)",
    )
    g.add_argument(
        "--decide-early",
        action="store_true",
        help="--find-rate: stop a probe once it is certain to miss the target (its attainment is then an "
        "upper bound; loadgen/effective.py MissBound)",
    )
    g.add_argument(
        "--max-rate",
        type=float,
        default=None,
        help="--find-rate: the highest rate probed; a policy that still meets the target there is reported "
        "as at least it (bracketed: false)",
    )
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--served-model", default=None, help="http: model name (default: the gateway's first)")
    g.add_argument(
        "--be-via",
        default="stream",
        choices=["stream", "batch-api"],
        help="http: send BE batches through /v1/files + /v1/batches (falls back to streaming on 404)",
    )
    e = p.add_argument_group("engine (inproc) and simulated workers (sim)")
    e.add_argument("--model", default="default")
    e.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    e.add_argument("--kv-cache-gib", type=float, default=None)
    e.add_argument("--num-blocks", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--num-threads", type=int, default=None, help="inproc: torch threads (default: as is)")
    e.add_argument(
        "--kv-heads-expand",
        action="store_true",
        default=None,
        help="inproc: repeat each KV head for its query heads: same outputs, MHA's KV memory shape",
    )
    e.add_argument(
        "--cost-model",
        default=None,
        help="a cost-model JSON file (`tandem profile` writes one) or the name of a profile shipped in "
        f"loadgen/sim/profiles ({', '.join(_shipped_profiles())}). sim: the simulated workers' step times and "
        f"what the policies plan with (default {DEFAULT_SIM_PROFILE}); inproc: what a cost-aware policy "
        "(bros, ellm, aptserve) plans with instead of the engine's own profile of this host",
    )
    add_aptserve_options(e)  # reaches the policy as `price_switches` (factory.policy_flags)
    e.add_argument("--workers", type=int, default=1, help="sim: number of workers")
    e.add_argument(
        "--placement",
        default=None,
        help="sim: placement policy (default: direct with one worker, least-loaded with several)",
    )
    e.add_argument(
        "--step-noise",
        default="lognormal:0.05",
        help="sim: noise on simulated step times: lognormal:CV, a saved jitter file "
        "(tandem-step-jitter/1), or none (docs/simulator.md, Fairness)",
    )
    e.add_argument(
        "--exact-planning",
        action="store_true",
        help="sim: let policies plan with the very cost model that sets step times "
        "(the old, unfair setup; default: a model fitted to a noisy simulated profile)",
    )
    e.add_argument(
        "--swap-space-gib",
        type=float,
        default=4.0,
        help="sim: host swap space per worker in GiB, the same for every policy (vLLM's default 4)",
    )
    e.add_argument(
        "--min-be-share",
        type=float,
        default=None,
        help="bros: BE's guaranteed share of scheduled tokens while it waits (default: the policy's, 0.1; 0 = off)",
    )
    e.add_argument(
        "--token-group",
        type=int,
        default=None,
        help="bros: RT tokens per deadline after the first (default 1: a deadline per token)",
    )
    e.add_argument(
        "--prefix-source",
        dest="source",
        default=None,
        choices=("rebuild", "host", "auto"),
        help="ellm: where non-resident prefixes come from: rebuilt, read from host swap space each step, or "
        "the cheaper per step (default rebuild; docs/ellm.md)",
    )
    e.add_argument(
        "--layer-split",
        action="store_true",
        default=None,
        help="ellm (sim): price eLLM's split of layers between host reads and rebuilding",
    )
    e.add_argument(
        "--be-fills-rt-ends",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bros: with no free block, BE may take the free end of an RT block (default: on)",
    )
    e.add_argument(
        "--be-order",
        choices=["arrival", "checkpointed"],
        default=None,
        help="bros: BE packing order, oldest first (default) or the paper's fewest-checkpointed first",
    )
    e.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="run each policy with this many seeds (--seed, --seed+1, ...) and report their spread",
    )
    e.add_argument(
        "--kv-bandwidth-gbps",
        type=float,
        default=None,
        help="sim: GB/s for moving a session's KV between workers (default: recompute)",
    )
    e.add_argument(
        "--session-mode",
        choices=("recompute", "recompute-cached", "load-aware", "hints"),
        default=None,
        help="sim: sessions' KV between turns (docs/sessions.md, 'Symphony at its own scale'); "
        "default: the plain path (--kv-bandwidth-gbps)",
    )
    e.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=None,
        help="sim: KV bytes per token instead of the profile's (device capacity and copy costs scale; "
        "step times do not)",
    )
    e.add_argument(
        "--session-disk-gbps",
        type=float,
        default=None,
        help="sim: an inclusive disk tier per worker read at this many GB/s (default: none)",
    )
    e.add_argument("--session-host-gib", type=float, default=64.0, help="sim: host tier per worker for sessions' KV")


def cmd_run(args: argparse.Namespace) -> int:
    return _execute(args, [args.policy])


def cmd_compare(args: argparse.Namespace) -> int:
    return _execute(args, _policies(args.policies))


def cmd_sim(args: argparse.Namespace) -> int:
    return _execute(args, _policies(args.policies), force_comparison=False)


def _policies(text: str) -> list[str]:
    out = [p.strip() for p in text.split(",") if p.strip()]
    if not out:
        raise ValueError("--policies needs at least one policy name")
    return out


def _execute(args: argparse.Namespace, policies: list[str], force_comparison: bool | None = None) -> int:
    from loadgen import report
    from loadgen.orchestrate import run_policies

    doc = run_policies(
        args,
        policies,
        comparison=len(policies) > 1 if force_comparison is None else force_comparison or len(policies) > 1,
        progress=not args.no_progress and sys.stderr.isatty(),
    )
    title = f"tandem loadgen: {args.workload} on {args.target}"
    print(report.summary_markdown(doc, title))
    if args.out:
        report.write(args.out, doc, title=title)
        print(f"wrote {args.out}/results.json, summary.md and plots", file=sys.stderr)
    return 0
