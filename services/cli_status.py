"""`tandem status`: the live cluster in one screen (or `--json`), read from the broker.

Exit status 0 when the broker answered, 1 when it did not (so scripts and health checks can
use it); what is collected and how is in `services/status.py`.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="print the live cluster: workers, load and KV, queue backlog, sessions, broker",
        description="Print the live cluster from the broker (KAFKA_BOOTSTRAP, TANDEM_TOPIC_PREFIX).",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from services.status import collect
    from shared.settings import ServiceSettings

    if args.timeout <= 0:
        raise ValueError("--timeout must be > 0")
    status = asyncio.run(collect(ServiceSettings(), timeout_s=args.timeout))
    print(status.model_dump_json(indent=2) if args.json else render(status))
    return 0 if status.reachable else 1


def render(s) -> str:
    """The status as text: a header, one row per worker, queues and sessions."""
    if not s.reachable:
        return f"broker {s.broker}: UNREACHABLE ({s.error})"
    lines = [
        f"broker {s.broker}: reachable, {s.topics_present}/{s.topics_expected} topics (prefix {s.topic_prefix!r})",
        "",
        f"{'worker':<24} {'state':<8} {'model':<16} {'RT run/wait':>11} {'BE run/wait':>11} {'KV':>6}"
        f" {'tok/s':>7} {'TTFT p50':>9} {'SLO':>5} {'profile':>7}",
    ]
    for w in s.workers:
        kv = "-" if w.kv_usage is None else f"{100 * w.kv_usage:.0f}%"
        tps = "-" if w.tokens_per_s is None else f"{w.tokens_per_s:.0f}"
        ttft = "-" if w.ttft_p50_s is None else f"{1000 * w.ttft_p50_s:.0f} ms"
        slo = "-" if w.slo_attainment is None else f"{100 * w.slo_attainment:.0f}%"
        profiled = "yes" if w.profiled else "no"
        lines.append(
            f"{w.worker_id:<24} {w.state:<8} {w.model:<16} {f'{w.rt_running}/{w.rt_waiting}':>11}"
            f" {f'{w.be_running}/{w.be_waiting}':>11} {kv:>6} {tps:>7} {ttft:>9} {slo:>5} {profiled:>7}"
        )
    if not s.workers:
        lines.append("(no worker heartbeats)")
    q = s.queues
    held = "" if q.scheduler_pending_be is None else f"; scheduler holds {q.scheduler_pending_be} BE"
    flight = "" if q.be_in_flight is None else f", {q.be_in_flight} BE in flight of {q.be_slots} slots"
    lines += [
        "",
        f"queues: requests.rt backlog {q.rt_backlog}, requests.be backlog {q.be_backlog}{held}{flight}",
        f"sessions: {s.sessions.sessions} with kept KV, {s.sessions.copies} copies, {s.sessions.bytes / 2**20:.1f} MiB",
    ]
    for pair in s.pairs:
        members = ", ".join(f"{i.instance} {i.state} ({i.age_s:.1f} s)" for i in pair.instances)
        lines.append(f"{pair.role} term {pair.term}: {members}")
    return "\n".join(lines)
