"""Validate the simulator against the CPU engine: same workload, same limits, wall clock vs model.

1. Calibrate: run the workload on the in-process engine at `--fit-rate` with another seed
   and fit the cost model to its logged steps (`sim/fit_steps.py`); or take `--cost-model`.
2. For each validation rate: run the workload on a fresh engine (wall clock), then in the
   simulator (one worker with the engine's KV pool size and batching limits). Unless
   `--no-jitter`, simulated steps replay the calibration steps' measured noise around the
   fitted model (`sim/jitter.py`), since this machine's latency tails are mostly noise.
3. Report TTFT/TPOT/TBT percentiles and attainments side by side with relative errors, and
   the cost model's error on the validation run's own steps (out of sample).

With `--calibration same-run` there is no calibration run: each validated run's cost model is
fitted to that run's own steps. The simulator is then judged with a cost model that matches
the machine's state during that run, so the comparison tests its scheduling and queueing, not
the machine's drift between runs (on the shared 2-core machine, identical runs differ by up
to 30%).

    python -m loadgen.sim.validate --rates 0.5,1.0 --duration 60 --json docs/results/sim-validation.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

METRICS = (
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "tbt_p99_s",
    "ttft_attainment",
    "tpot_attainment",
    "slo_attainment",
    "throughput_rps",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workload", default="sharegpt")
    ap.add_argument("--rates", default="0.5,1.0", help="comma-separated request rates")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--length-scale", type=float, default=0.25)
    ap.add_argument("--slo-scale", type=float, default=2.0)
    ap.add_argument("--policy", default="fcfs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch threads; 1 keeps a shared 2-core machine's other load from stalling every op",
    )
    ap.add_argument("--fit-rate", type=float, default=1.0, help="rate of the calibration run")
    ap.add_argument("--fit-seed", type=int, default=100)
    ap.add_argument("--cost-model", default=None, help="use this cost model instead of a calibration run")
    ap.add_argument(
        "--calibration",
        choices=("separate", "same-run"),
        default="separate",
        help="separate: fit on a calibration run (other seed and rate: out of sample); same-run: fit "
        "on each validated run's own steps, which leaves out the machine's drift between runs",
    )
    ap.add_argument(
        "--jitter",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay the calibration steps' measured noise onto simulated steps (sim/jitter.py)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = validate(args)
    print(format_table(out))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def validate(args: argparse.Namespace) -> dict:
    from engine.cost_model import CostModel
    from loadgen.sim.fit_steps import fit_steps

    ns = argparse.Namespace(
        model=args.model,
        dtype=args.dtype,
        seed=args.seed,
        cost_model=None,
        kv_cache_gib=None,
        num_blocks=None,
        max_num_seqs=None,
        max_num_batched_tokens=None,
        max_model_len=None,
        num_threads=args.num_threads,
    )
    cost = jitter = None
    if args.cost_model:
        cost = CostModel.load(args.cost_model)
    elif args.calibration == "separate":
        fit_run, target = _engine_run(ns, args, args.fit_rate, args.fit_seed)
        cost = fit_steps(target.step_log, meta={"fit_rate": args.fit_rate, "fit_seed": args.fit_seed})
        jitter = _jitter(args, cost, target.step_log)
    if cost is not None:
        _log(f"cost model: prefill {cost.prefill}, decode {cost.decode}, meta {cost.meta}")
    runs = []
    for rate in [float(r) for r in args.rates.split(",")]:
        engine_run, target = _engine_run(ns, args, rate, args.seed)
        run_cost = cost or fit_steps(target.step_log, meta={"fit_rate": rate, "fit_seed": args.seed})
        run_jitter = jitter if cost is not None else _jitter(args, run_cost, target.step_log)
        runs.append(_compare(args, rate, engine_run, target, run_cost, run_jitter))
        _log(format_table({"runs": runs[-1:]}))
    from loadgen.provenance import decided_dtype, stamp

    return {
        "config": vars(args),
        "cost_model": None if cost is None else cost.to_dict(),
        "runs": runs,
        "provenance": stamp(dtype=decided_dtype(args.dtype)).as_dict(),
    }


def _compare(args, rate: float, engine_run, target, cost, jitter) -> dict:
    """One validated rate: the engine's RT summary against the simulator's (and, with jitter,
    against the noise-free simulation too)."""
    from loadgen.metrics import summarize

    def rt(result) -> dict:
        return summarize(result.records, result.elapsed_s)["rt"]

    e, sim_run = rt(engine_run), _sim_run(args, target, cost, rate, jitter)
    s = rt(sim_run)
    run = {
        "rate": rate,
        "engine": e,
        "sim": s,
        "step_mape": _step_mape(cost, target.step_log),
        "engine_steps": len(target.step_log),
        "sim_steps": sim_run.target.get("steps"),
        "cost_model": cost.to_dict(),
        "jitter": jitter is not None,
        "relative_error": {k: _rel(s.get(k), e.get(k)) for k in METRICS},
    }
    if jitter is not None:
        plain = rt(_sim_run(args, target, cost, rate))
        run["sim_without_jitter"] = plain
        run["relative_error_without_jitter"] = {k: _rel(plain.get(k), e.get(k)) for k in METRICS}
    return run


def _engine_run(ns, args, rate: float, seed: int):
    from loadgen.driver import Driver
    from loadgen.factory import inproc_target

    bundle = inproc_target(ns, args.policy)  # a fresh engine: no inherited prefix cache
    engine = bundle.target.engine
    res = Driver(bundle.target, _workload(args, rate, seed, engine.max_model_len), bundle.prompts).run()
    return res, bundle.target


def _jitter(args, cost, steps):
    """The calibration steps' noise around the fitted model, or None (`--no-jitter`)."""
    from loadgen.sim.jitter import StepJitter

    if not args.jitter or not steps:
        return None
    return StepJitter.from_steps([t for *_, t in steps], [cost.estimate(p, d) for p, d, _ in steps])


def _sim_run(args, target, cost, rate: float, jitter=None):
    from loadgen.driver import Driver
    from loadgen.prompts import PromptBuilder
    from loadgen.sim.cluster import SimTarget
    from loadgen.sim.worker import SimWorker, WorkerSpec

    engine = target.engine
    spec = WorkerSpec(
        num_blocks=engine.kv.pool.num_blocks,
        block_size=engine.config.block_size,
        max_num_seqs=engine.config.max_num_seqs,
        max_num_batched_tokens=engine.config.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
    )
    prompts = PromptBuilder(engine.model_config.vocab_size, args.seed)
    sim = SimTarget([SimWorker("w0", spec, cost, args.policy, jitter=jitter, seed=args.seed)])
    return Driver(sim, _workload(args, rate, args.seed, engine.max_model_len), prompts).run()


def _workload(args, rate: float, seed: int, max_len: int):
    from loadgen.arrivals import ArrivalSpec
    from loadgen.workloads.build import WorkloadConfig, build_workload

    return build_workload(
        WorkloadConfig(
            args.workload,
            ArrivalSpec("poisson", rate),
            args.duration,
            seed,
            length_scale=args.length_scale,
            slo_scale=args.slo_scale,
            max_len=max_len,
        )
    )


def _step_mape(cost, steps) -> float:
    errs = [abs(cost.estimate(p, d) - t) / t for p, d, t in steps]
    return sum(errs) / len(errs) if errs else 0.0


def _rel(sim, real):
    if sim is None or real is None or real == 0:
        return None
    return (sim - real) / real


def format_table(out: dict) -> str:
    lines = []
    for run in out["runs"]:
        lines.append(f"rate {run['rate']} req/s (cost model error on this run's steps: {run['step_mape']:.1%})")
        plain = run.get("sim_without_jitter")
        lines.append(
            f"{'metric':<18}{'engine':>10}{'sim':>10}{'error':>9}"
            + (f"{'sim, no jitter':>16}{'error':>9}" if plain else "")
        )
        for k in METRICS:
            e, s, r = run["engine"].get(k), run["sim"].get(k), run["relative_error"].get(k)
            line = f"{k:<18}{_f(e):>10}{_f(s):>10}{_pct(r):>9}"
            if plain:
                line += f"{_f(plain.get(k)):>16}{_pct(run['relative_error_without_jitter'].get(k)):>9}"
            lines.append(line)
    return "\n".join(lines)


def _pct(r) -> str:
    return "" if r is None else f"{r:+.1%}"


def _f(v) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
