"""`tandem bench placement`: SLO-aware vs least-loaded placement at cluster scale, simulated.

The cluster simulator (`loadgen/sim/cluster.py`) runs the scheduler's own placement policies
over tens of simulated workers: each runs the engine's scheduler and KV manager with a
profiled cost model. One workload mixes the three kinds of traffic a cluster sees: single-turn
RT chat (ShareGPT-like, Poisson), multi-turn sessions (Poisson starts, human reading/typing sped
up by `--speedup` so turns come within the run) and a standing BE backlog. Every placement
sees the same arrivals (same seed); several seeds give the spread.

The cluster is heterogeneous by default: `--slow-share` of the workers run the profile slowed
by `--slow-factor` (an older GPU generation beside a newer one, as fleets are); least-loaded
counts requests, so it gives a slow worker the same share as a fast one. `--slow-factor 1`
makes every worker alike.

Reported per placement: RT SLO attainment (TTFT and TPOT both met, over RT requests and
session turns), TTFT/TPOT percentiles, BE throughput, the placement decisions, per seed and as
mean/min/max over seeds. JSON (`--json`) carries the provenance stamp.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from loadgen.bench.common import write_json

SPEEDUP_WPM = 10.0  # human reading/typing sped up so a session's turns arrive within minutes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("placement", help="SLO-aware vs least-loaded placement on a simulated cluster")
    p.add_argument("--workers", type=int, default=24)
    p.add_argument("--slow-share", type=float, default=0.5, help="share of workers on the slower profile")
    p.add_argument("--slow-factor", type=float, default=2.0, help="step-time multiplier of the slower workers")
    p.add_argument("--profile", default="opt-13b-a100-40gb", help="shipped cost model name or file")
    p.add_argument("--rt-rate", type=float, default=20.0, help="single-turn RT requests per second")
    p.add_argument("--session-rate", type=float, default=2.0, help="new sessions per second")
    p.add_argument("--be-batch", type=int, default=48, help="standing BE backlog (requests kept queued)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (simulated)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--placements", default="least-loaded,slo", help="the first is the baseline")
    p.add_argument("--kv-bandwidth-gbps", type=float, default=10.0, help="KV link between workers (0: recompute)")
    p.add_argument("--slo-ttft", type=float, default=None, help="RT TTFT SLO in s (default: the profile's)")
    p.add_argument("--slo-tpot", type=float, default=None, help="RT TPOT SLO in s (default: the profile's)")
    p.add_argument("--json", default=None, help="write results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loadgen.provenance import stamp

    placements = [p for p in args.placements.split(",") if p]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if not placements or not seeds:
        raise ValueError("need at least one placement and one seed")
    runs = {p: [run_one(args, p, seed) for seed in seeds] for p in placements}
    result = {
        "bench": "placement",
        "config": {k: v for k, v in vars(args).items() if k not in ("func", "json", "command", "bench_command")},
        "per_seed": runs,
        "summary": {p: spread(rs) for p, rs in runs.items()},
        "provenance": stamp(extra={"target": "sim"}).as_dict(),
    }
    print(format_result(result))
    write_json(result, args.json)
    return 0


def run_one(args: argparse.Namespace, placement: str, seed: int) -> dict:
    """One simulated run: the cluster built fresh, the seed's arrivals, `placement` placing."""
    from loadgen.driver import Driver
    from loadgen.factory import load_cost_model
    from loadgen.metrics import summarize
    from loadgen.prompts import PromptBuilder
    from loadgen.sim.cluster import ClusterSpec, SimTarget
    from loadgen.sim.worker import SimWorker

    cost = load_cost_model(args.profile)
    spec = _worker_spec(cost.meta)
    n_slow = round(args.workers * args.slow_share)
    workers = [
        SimWorker(f"w{i}", spec, slowed(cost, args.slow_factor) if i < n_slow else cost, "fcfs")
        for i in range(args.workers)
    ]
    bw = args.kv_bandwidth_gbps * 1e9 if args.kv_bandwidth_gbps else None
    target = SimTarget(workers, ClusterSpec(placement, bw))
    workload = mixed_workload(args, seed, spec.max_model_len)
    result = Driver(target, workload, PromptBuilder(spec.vocab_size, seed)).run()
    summary = summarize(result.records, result.elapsed_s)
    rt, be = summary["rt"], summary["be"]
    return {
        "seed": seed,
        "rt_requests": rt["requests"],
        "rt_slo_attainment": rt["slo_attainment"],
        "rt_ttft_attainment": rt["ttft_attainment"],
        "rt_ttft_p50_s": rt["ttft_p50_s"],
        "rt_ttft_p99_s": rt["ttft_p99_s"],
        "rt_tpot_p50_s": rt["tpot_p50_s"],
        "rt_tpot_p99_s": rt["tpot_p99_s"],
        "be_completed": be["completed"],
        "be_output_tokens_per_s": be["output_tokens_per_s"],
        "decisions": result.target.get("placement_decisions", {}),
        "kv_transfers": result.target.get("kv_transfers", 0),
        "prompt_tokens_cached": result.target.get("prompt_tokens_cached", 0),
    }


def mixed_workload(args: argparse.Namespace, seed: int, max_len: int):
    """Single-turn RT and a BE backlog (`rt-be`) plus Poisson sessions, on one clock."""
    from loadgen.arrivals import ArrivalSpec
    from loadgen.workloads.build import Workload, WorkloadConfig, build_workload
    from loadgen.workloads.sources import HumanSpeeds

    base = WorkloadConfig(
        name="rt-be",
        arrival=ArrivalSpec("poisson", args.rt_rate),
        duration_s=args.duration,
        seed=seed,
        slo_ttft_s=args.slo_ttft,
        slo_tpot_s=args.slo_tpot,
        max_len=max_len,
        be_batch=args.be_batch,
        speeds=HumanSpeeds(250.0 * SPEEDUP_WPM, 40.0 * SPEEDUP_WPM),
    )
    rt_be = build_workload(base)
    sessions = build_workload(replace(base, name="sessions", arrival=ArrivalSpec("poisson", args.session_rate)))
    return Workload(base, rt_be.open_loop, rt_be.sources + sessions.sources)


def slowed(cost, factor: float):
    """`cost` with every step `factor` times longer (an older GPU running the same model)."""
    from engine.cost_model import CostModel, PhaseFit

    if factor == 1.0:
        return cost

    def scale(p: PhaseFit) -> PhaseFit:
        return PhaseFit(p.alpha0 * factor, p.alpha1 * factor, p.beta * factor)

    meta = {**cost.meta, "slowed_by": factor}
    return CostModel(scale(cost.prefill), scale(cost.decode), cost.swap_bytes_per_s / factor, meta)


def _worker_spec(meta: dict):
    from loadgen.sim.worker import WorkerSpec

    block = int(meta.get("block_size", 16))
    num_blocks = int(meta["kv_capacity_tokens"]) // block + 1 if "kv_capacity_tokens" in meta else 4096
    return WorkerSpec(
        num_blocks=num_blocks,
        block_size=block,
        max_num_seqs=128,
        max_num_batched_tokens=2048,
        max_model_len=int(meta.get("max_model_len", 2048)),
        kv_bytes_per_token=int(meta.get("kv_bytes_per_token", 0)),
    )


def spread(runs: list[dict]) -> dict:
    """Mean, min and max over seeds of each numeric figure."""
    out = {}
    for key in ("rt_slo_attainment", "rt_ttft_attainment", "rt_ttft_p99_s", "rt_tpot_p99_s", "be_output_tokens_per_s"):
        values = [r[key] for r in runs if r[key] is not None]
        if values:
            out[key] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
    return out


def format_result(result: dict) -> str:
    lines = ["placement | RT SLO attainment mean [min, max] | RT TTFT p99 s | RT TPOT p99 s | BE tok/s"]
    for name, s in result["summary"].items():
        att, ttft, tpot, be = (
            s.get(k, {}) for k in ("rt_slo_attainment", "rt_ttft_p99_s", "rt_tpot_p99_s", "be_output_tokens_per_s")
        )
        lines.append(
            f"{name} | {att.get('mean', 0):.3f} [{att.get('min', 0):.3f}, {att.get('max', 0):.3f}]"
            f" | {ttft.get('mean', 0):.2f} | {tpot.get('mean', 0):.3f} | {be.get('mean', 0):.0f}"
        )
    return "\n".join(lines)
