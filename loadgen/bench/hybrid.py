"""`tandem bench hybrid` (or `python -m loadgen.bench.hybrid`): the hybrid cache on the CPU
engine (issue 17), `aptserve` against `fcfs` on the same arrivals, with what the issue asks to
see beside the attainment: how often HIDDEN is chosen, what the rebuild costs per step, the
batch sizes reached and the preemptions.

Setup: the default model with `--kv-heads-expand` (MHA's memory shape: a hidden row is half a
token's K+V), a KV pool of `--num-blocks` small enough to bind, ShareGPT lengths scaled by
`--length-scale`, the paper's SLO (TTFT <= 1 s, P99 TBT <= 1 s). The engine is profiled once
first (`engine.profiling.profile`, with ρ: the profiler's own HIDDEN-vs-KV timing) and the
profile is given to every run (`cost_model_path`): `aptserve` takes ρ and the re-prefill price
of a conversion from it. `--cost-model` reuses a saved profile (one per machine state: the
seeds and rates of one measurement share it); `--rho` overrides ρ alone.

`--model tiny-opt` runs a random-weight MHA OPT (`tiny_model.py`) instead: the comparison of
schedules on a binding pool at a fraction of the default model's step time, for a host too
busy for the default model (the SLO, lengths and pool are the same; what a step costs is not,
so its numbers are about packing, not about this CPU's speed).

Rounds: for every rate and seed each policy runs once, on the same arrivals, the order
rotating from one (rate, seed) to the next, so that a busy machine's noise falls on every
policy; each run records the load average before and after it. `summary` gives, per rate and
policy, the mean and range over seeds, the paired per-seed ratios to the first policy, and the
coarse effective throughput: the highest *tested* rate at which each seed attains 90% (60%)
(both in `hybrid_summary.py`).

Policies: `fcfs`, `aptserve` (the paper's unpriced conversions, the default),
`aptserve-priced` (`aptserve_price_switches=True`; the JSON of commit 3c17aed names these two
`aptserve-free` and `aptserve`) and `aptserve-paper-hidden` (HIDDEN admitted by the paper's
rule alone, `withhold_dropped_hidden=False`: the ablation of "When HIDDEN pays").
Each step's wall time, batch size and HIDDEN rows are logged,
split into HIDDEN prefill rows with no stored context (a first chunk: nothing to rebuild) and
rows that rebuild K/V from stored context; the rebuild cost of a step is its HIDDEN context
tokens x the profiled per-token cost. (Before this split `mean_rebuild_s_per_hidden_step`
read 0.0 in every run: every HIDDEN row was a first prefill, converted back to KV at the next
decode iteration; docs/aptserve.md.) One JSON document (with the provenance stamp) is written
to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from loadgen.bench.hybrid_summary import rounds, summarize_runs

POLICIES = {
    "fcfs": ("fcfs", {}),
    "aptserve": ("aptserve", {"price_switches": False}),
    "aptserve-priced": ("aptserve", {"price_switches": True}),
    # HIDDEN by the paper's rule alone: admitted where the next decode iteration drops it
    # (docs/aptserve.md, "When HIDDEN pays"; the simulator's `aptserve-paper-hidden`)
    "aptserve-paper-hidden": ("aptserve", {"price_switches": False, "withhold_dropped_hidden": False}),
}


def _engine_config(args: argparse.Namespace, policy: str, cost_model_path: str | None):
    from engine import EngineConfig

    name, options = POLICIES[policy]
    extra = {}
    if name == "aptserve":
        extra = {"aptserve_rho": args.rho, "aptserve_price_switches": options["price_switches"]}
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        policy=name,
        cost_model_path=cost_model_path,
        num_blocks=args.num_blocks,
        kv_heads_expand=True,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,  # also bounds the ρ grid's contexts (128, 512 below 1024)
        seed=0,
        num_threads=args.threads,
        **extra,
    )


def profile_engine(args: argparse.Namespace, path: Path) -> dict:
    """Profile this engine once (a pool large enough for the grid, ρ included) into `path`."""
    from dataclasses import replace

    from engine import LLMEngine
    from engine.profiling import profile
    from loadgen.provenance import stamp

    config = replace(_engine_config(args, "fcfs", None), num_blocks=max(args.num_blocks, 1200))
    # stamped like every result file (commit, dirty flag, CPU, threads, load; at the start, as the
    # run's): a saved profile is reused by later runs (`--cost-model`), apart from the run JSON
    # whose stamp covered it. CostModel.load keeps unknown `meta` keys.
    prov = stamp(dtype=args.dtype).as_dict()
    cost = profile(LLMEngine(config).profile_target())
    cost.meta["provenance"] = prov
    path.parent.mkdir(parents=True, exist_ok=True)
    cost.save(path)
    return _profile_summary(cost, config.block_size, str(path))


def _profile_summary(cost, block_size: int, path: str) -> dict:
    return {
        "path": path,
        "per_token_s": cost.hidden_s_per_token,
        "rho_s_per_block": None if cost.hidden_s_per_token is None else cost.hidden_s_per_token * block_size,
        "overhead_s": cost.meta.get("hidden_step_overhead_s"),
        "points": cost.meta.get("hidden_points"),
        "prefill": cost.prefill.to_dict(),
        "decode": cost.decode.to_dict(),
        # how it was measured and whether it can be trusted (engine/profile_trust.py)
        "record": _judged(path),
    }


def _judged(path: str) -> dict:
    from engine.profile_cache import given_profile

    return given_profile(path, None).record.as_dict()


def run_one(
    args: argparse.Namespace, policy: str, seed: int, rate: float, cost_model_path: str, per_token: float
) -> dict:
    from engine.kv.hidden import CacheForm
    from loadgen.arrivals import ArrivalSpec
    from loadgen.driver import Driver
    from loadgen.metrics import summarize
    from loadgen.prompts import PromptBuilder
    from loadgen.targets.inproc import InprocTarget
    from loadgen.workloads.build import WorkloadConfig, build_workload
    from loadgen.workloads.random_tokens import special_token_ids

    load_before = _load_average()
    target = InprocTarget.from_config(_engine_config(args, policy, cost_model_path))
    engine = target.engine
    withhold = POLICIES[policy][1].get("withhold_dropped_hidden")
    if withhold is not None:  # an ablation switch of the policy object, not an engine setting
        engine.scheduler.policy.withhold_dropped_hidden = withhold
    # aptserve's knapsack inputs per iteration (why HIDDEN is or is not chosen; changes nothing)
    # imported here, not at the top: the recorder needs engine.kv (torch), and `tandem --help`
    # builds this command's parser in every service's start (tests/test_cli.py)
    from loadgen.sim.apt_knapsack_trace import KnapsackRecorder

    recorder = KnapsackRecorder(engine.scheduler.policy) if hasattr(engine.scheduler.policy, "hidden_chosen") else None
    steps: list[dict] = []
    schedule = engine.scheduler.schedule

    def logged(now=None):
        batch = schedule(now)
        if batch:
            hidden = [it for it in batch.items if it.request.cache_form is CacheForm.HIDDEN]
            steps.append(
                {
                    "batch": len(batch.items),
                    "decode_rows": sum(1 for it in batch.items if it.num_new_tokens == 1),
                    "hidden_rows": len(hidden),
                    # rows with stored context rebuild K/V; a first chunk (none stored) does not
                    "hidden_rebuild_rows": sum(1 for it in hidden if it.request.num_computed_tokens),
                    "hidden_ctx_tokens": sum(it.request.num_computed_tokens for it in hidden),
                    "preempted": len(batch.preempted),
                }
            )
        return batch

    engine.scheduler.schedule = logged
    step = engine.step

    def timed_step():
        t0 = time.perf_counter()
        out = step()
        if steps and "seconds" not in steps[-1]:
            steps[-1]["seconds"] = time.perf_counter() - t0
        return out

    engine.step = timed_step
    mc = engine.model_config
    exclude = special_token_ids(engine.tokenizer, extra=[mc.bos_token_id, *mc.eos_token_ids])
    cfg = WorkloadConfig(
        "sharegpt",
        ArrivalSpec("poisson", rate),
        args.duration,
        seed=seed,
        length_scale=args.length_scale,
        slo_ttft_s=1.0 * args.slo_scale,
        slo_tpot_s=1.0 * args.slo_scale,
        max_len=engine.max_model_len,
    )
    result = Driver(target, build_workload(cfg), PromptBuilder(mc.vocab_size, seed, exclude, engine.tokenizer)).run()
    rt = summarize(result.records, result.elapsed_s)["rt"]
    policy_obj = engine.scheduler.policy
    timed = [s for s in steps if "seconds" in s]
    decode_steps = [s for s in timed if s["decode_rows"] == s["batch"]]
    rebuilding = [s for s in timed if s["hidden_rebuild_rows"]]
    return {
        "policy": policy,
        "rate": rate,
        "seed": seed,
        "profile": engine.profile_record.brief() if engine.profile_record is not None else None,
        "slo_attainment": rt["slo_attainment"],
        "ttft_attainment": rt["ttft_attainment"],
        "tbt_p99_attainment": rt["tbt_p99_attainment"],
        "completed": rt["completed"],
        "requests": rt["requests"],
        # requests that met the SLO per second of arrivals: what effective throughput counts
        "goodput_rps": rt["slo_attainment"] * rt["requests"] / args.duration,
        "steps": len(timed),
        "mean_batch": statistics.mean(s["batch"] for s in timed) if timed else 0,
        "max_batch": max((s["batch"] for s in timed), default=0),
        "mean_decode_batch": statistics.mean(s["batch"] for s in decode_steps) if decode_steps else 0,
        "preemptions": engine.stats.preemptions,
        "conversions": getattr(policy_obj, "conversions", 0),
        "hidden_chosen": getattr(policy_obj, "hidden_chosen", 0),
        "hidden_withheld": getattr(policy_obj, "hidden_withheld", None),
        "withhold_dropped_hidden": getattr(policy_obj, "withhold_dropped_hidden", None),
        "kv_chosen": getattr(policy_obj, "kv_chosen", None),
        "row_count": sum(s["batch"] for s in timed),
        "hidden_rows": sum(s["hidden_rows"] for s in timed),
        "hidden_rebuild_rows": sum(s["hidden_rebuild_rows"] for s in timed),
        "hidden_row_share": sum(s["hidden_rows"] for s in timed) / max(1, sum(s["batch"] for s in timed)),
        "steps_with_hidden": sum(1 for s in timed if s["hidden_rows"]),
        "steps_rebuilding": len(rebuilding),
        "mean_step_s": statistics.mean(s["seconds"] for s in timed) if timed else 0,
        "mean_step_s_with_hidden": _mean(s["seconds"] for s in timed if s["hidden_rows"]),
        "mean_step_s_rebuilding": _mean(s["seconds"] for s in rebuilding),
        "mean_rebuild_s_per_step": _mean(s["hidden_ctx_tokens"] * per_token for s in timed),
        # priced from the profile over the steps that rebuild anything (None: no such step)
        "mean_rebuild_s_per_hidden_step": _mean(s["hidden_ctx_tokens"] * per_token for s in rebuilding),
        "schedule_time_s": engine.stats.schedule_time_s,
        "knapsack": recorder.summary() if recorder is not None else None,
        "kv_blocks": engine.kv.pool.capacity,
        # a busy host slows every step: the load average around each run says how busy
        "load_average_before": load_before,
        "load_average_after": _load_average(),
    }


def _load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _mean(values) -> float | None:
    values = list(values)
    return statistics.mean(values) if values else None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "hybrid",
        help="aptserve vs fcfs on the CPU engine with the MHA-expanded model (the hybrid cache, issue 17)",
        description=__doc__.split("\n\n")[0],
    )
    add_args(p)
    p.set_defaults(func=run)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="default", help="a model, or `tiny-opt` (random-weight MHA OPT, tiny_model.py)")
    ap.add_argument("--dtype", default="float32", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--num-blocks", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument(
        "--slo-scale",
        type=float,
        default=1.0,
        help="the paper's SLO (TTFT 1 s, P99 TBT 1 s) times this: >1 where a busy host slows every step",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: as is)")
    ap.add_argument("--rates", default="1.0", help="comma-separated request rates (req/s)")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--length-scale", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0, help="the first workload seed")
    ap.add_argument("--seeds", type=int, default=3, help="how many seeds (seed, seed+1, ...)")
    ap.add_argument("--policies", default="fcfs,aptserve", help=f"among {sorted(POLICIES)}; the first is the baseline")
    ap.add_argument("--cost-model", default=None, help="a saved profile of this engine; default: profile first")
    ap.add_argument("--rho", type=float, default=None, help="s per block; default: the profile's")
    ap.add_argument("--out", "--json", dest="out", default=None, help="write the results document here")


def parser() -> argparse.ArgumentParser:
    """This bench's options on a parser of its own (`tandem repro aptserve --engine` parses its
    cells with it)."""
    ap = argparse.ArgumentParser(prog="tandem bench hybrid", description=__doc__.split("\n\n")[0])
    add_args(ap)
    return ap


def run(args: argparse.Namespace) -> int:
    doc = measure(args)
    print(json.dumps(doc["summary"], indent=1))
    return 0


def measure(args: argparse.Namespace) -> dict:
    """Profile (unless given a profile), run every round, and return the stamped document (also
    written to `args.out` when set; the profile goes beside it, or to a temporary file)."""
    import tempfile

    from engine.cost_model import CostModel
    from loadgen.provenance import stamp

    policies = args.policies.split(",")
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; available: {sorted(POLICIES)}")
    if args.model == "tiny-opt":
        from loadgen.bench.tiny_model import tiny_mha_opt

        args.model = str(tiny_mha_opt())
    prov = stamp(dtype=args.dtype).as_dict()  # at the start: the code that runs is the code checked out now
    block_size = _engine_config(args, "fcfs", None).block_size
    if args.cost_model is None:
        where = Path(args.out).with_suffix(".profile.json") if args.out else Path(tempfile.mkdtemp()) / "profile.json"
        profile = profile_engine(args, where)
    else:
        profile = _profile_summary(CostModel.load(args.cost_model), block_size, args.cost_model)
    per_token = args.rho / block_size if args.rho is not None else profile["per_token_s"]
    print(json.dumps({"profile": {k: profile[k] for k in ("path", "per_token_s", "rho_s_per_block")}}), flush=True)
    rates = [float(r) for r in args.rates.split(",")]
    seeds = list(range(args.seed, args.seed + args.seeds))
    runs = []
    for rate, seed, policy in rounds(policies, rates, seeds):
        runs.append(run_one(args, policy, seed, rate, profile["path"], per_token))
        print(
            json.dumps({k: runs[-1][k] for k in ("rate", "seed", "policy", "slo_attainment", "load_average_after")}),
            flush=True,
        )
    doc = {
        "bench": "hybrid",
        "command": "tandem bench hybrid " + " ".join(_argv(args)),
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "profile": profile,
        "summary": summarize_runs(runs, policies),
        "runs": runs,
        "provenance": prov,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2))
    return doc


def _argv(args: argparse.Namespace) -> list[str]:
    out = []
    for k, v in vars(args).items():
        if k != "func" and v is not None:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
