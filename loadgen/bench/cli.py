"""`tandem bench ...`: registers the benchmark subcommands."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks (engine throughput, baselines)",
        description="Benchmarks. All share the same random-token workload arguments.",
    )
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    bsub.required = True
    from loadgen.baselines import hf_bench
    from loadgen.bench import (
        batch,
        compare,
        cpu_step_profile,
        ellm_ab,
        ellm_decision,
        ellm_decision_ab,
        ellm_sim,
        engine,
        gateway,
        gateway_ab,
        hybrid,
        idle,
        kafka_path,
        loop_contention,
        placement,
        policies,
        sessions,
    )

    engine.add_parser(bsub)
    compare.add_parser(bsub)
    cpu_step_profile.add_parser(bsub)  # tandem bench profile
    policies.add_parser(bsub)
    gateway.add_parser(bsub)
    gateway_ab.add_parser(bsub)
    idle.add_parser(bsub)
    kafka_path.add_parser(bsub)
    loop_contention.add_parser(bsub)
    batch.add_parser(bsub)
    sessions.add_parser(bsub)
    ellm_ab.add_parser(bsub)
    ellm_decision.add_parser(bsub)
    ellm_decision_ab.add_parser(bsub)
    ellm_sim.add_parser(bsub)
    hybrid.add_parser(bsub)
    placement.add_parser(bsub)
    hf_bench.add_parser(bsub)
