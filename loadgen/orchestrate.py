"""Run one workload for several policies (same arrivals), optionally searching the effective
throughput, and assemble the results document."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from loadgen.driver import Driver, RunResult
from loadgen.effective import MissBound, effective_throughput
from loadgen.factory import TargetBundle, inproc_target, sim_target, workload_config
from loadgen.metrics import summarize
from loadgen.workloads.build import build_workload


def run_policies(args: argparse.Namespace, policies: list[str], *, comparison: bool, progress: bool) -> dict:
    from loadgen import report

    stamp = _stamp(args)  # at the start: the code that runs is the code checked out now
    scale = _SloScale(args)
    results: dict[str, RunResult] = {}
    effective: dict[str, dict] = {}
    seeds = [args.seed + i for i in range(max(1, getattr(args, "seeds", 1) or 1))]
    per_seed: dict[str, list[dict]] = {}
    pooled: dict[str, dict] = {}
    for policy in policies:
        if args.find_rate:
            effective[policy] = _search(args, policy, scale).as_dict()
        results[policy] = run_once(args, policy, scale, args.rate, progress)
        _log(f"{policy}: done in {results[policy].elapsed_s:.1f} s of {'simulated' if _is_sim(args) else 'run'} time")
        per_seed[policy] = [summarize(results[policy].records, results[policy].elapsed_s)]
        records, elapsed = list(results[policy].records), results[policy].elapsed_s
        for seed in seeds[1:]:  # only the first seed's requests go into the document (size)
            res = run_once(argparse.Namespace(**{**vars(args), "seed": seed}), policy, scale, args.rate, False)
            per_seed[policy].append(summarize(res.records, res.elapsed_s))
            records += res.records
            elapsed += res.elapsed_s
            _log(f"{policy}: seed {seed} done")
        if len(seeds) > 1:
            # every seed's measured requests as one sample: a percentile over all of them (a p99
            # from a few requests per seed is their maximum; the seeds' mean of it is not a p99)
            pooled[policy] = summarize(records, elapsed)
    config = _config(args, policies, scale)
    if comparison:
        doc = report.comparison_document(results, config, effective or None)
    else:
        doc = report.run_document(results[policies[0]], config, effective or None)
    if len(seeds) > 1:
        from loadgen.spread import seed_spread

        doc["seeds"] = seed_spread(seeds, per_seed)
        doc["seeds"]["pooled"] = pooled
    # which cost profile each policy planned from (engine/profile_cache.py; None: it used none)
    profiles = {p: (r.target or {}).get("cost_model_profile") for p, r in results.items()}
    if any(profiles.values()):
        doc["profiles"] = profiles
    doc["provenance"] = stamp
    return doc


def _stamp(args: argparse.Namespace) -> dict:
    """Provenance of this run (loadgen/provenance.py). The dtype is the engine's for inproc and
    sim (the simulator sizes KV by it), decided as the engine decides "auto"; an HTTP target's
    dtype is the server's business, so it is not claimed."""
    from loadgen.provenance import decided_dtype, stamp

    dtype = None if _is_http(args) else decided_dtype(getattr(args, "dtype", None))
    return stamp(dtype=dtype, extra={"target": args.target}).as_dict()


def run_once(
    args: argparse.Namespace,
    policy: str,
    scale: _SloScale,
    rate: float,
    progress: bool,
    stop_below: float | None = None,
    on_target=None,
) -> RunResult:
    """One run; `stop_below`: end it once its SLO attainment is certain to stay below this
    (`MissBound`, open-loop workloads only; `RunResult.stopped_early`, `.attainment_at_most`);
    `on_target(target)` sees the built target before the run (a recorder's hook:
    `loadgen.sim.probe_trace`)."""
    if _is_http(args):
        from loadgen.targets.http import run_http

        cfg = workload_config(args, max_len=args.max_model_len, slo_scale=scale.value(None), rate=rate)
        return run_http(args.target, build_workload(cfg), args, progress=progress)
    bundle = _target(args, policy, scale)
    if on_target is not None:
        on_target(bundle.target)
    try:
        cfg = workload_config(args, max_len=bundle.max_len, slo_scale=scale.value(bundle), rate=rate)
        _install_policy(bundle, policy, cfg)
        count = (lambda text: len(bundle.tokenizer.encode(text))) if bundle.tokenizer is not None else None
        workload = build_workload(cfg, count) if count else build_workload(cfg)
        bound = _miss_bound(workload, stop_below)
        result = Driver(
            bundle.target,
            workload,
            bundle.prompts,
            drain_timeout_s=args.drain_timeout,
            progress=progress,
            stop_when=bound,
        ).run()
        if result.stopped_early:
            result = dataclasses.replace(result, attainment_at_most=bound.at_most)
        return measured_window(result, getattr(args, "warmup_s", 0.0) or 0.0)
    finally:
        bundle.target.close()


def _miss_bound(workload, stop_below: float | None) -> MissBound | None:
    """The early stop of a probe over this window's requests; None where the window's size is
    not known in advance (closed-loop sources) or none was asked for."""
    if stop_below is None or workload.sources:
        return None
    window = workload.config.duration_s
    total = sum(1 for sub in workload.open_loop if sub.at_s < window and _has_slo(sub.spec.slo))
    return MissBound(stop_below, total) if total else None


def _has_slo(slo) -> bool:
    return slo.ttft_s is not None or slo.tpot_s is not None


def measured_window(result: RunResult, warmup_s: float) -> RunResult:
    """The run less its warm-up: requests that arrived before `warmup_s` are dropped from the
    records (and so from every summary), and rates are over the rest of the run."""
    if warmup_s < 0:
        raise ValueError(f"--warmup-s must be >= 0, got {warmup_s}")
    if warmup_s == 0:
        return result
    if warmup_s >= result.elapsed_s:
        raise ValueError(f"--warmup-s {warmup_s} leaves nothing of a {result.elapsed_s:.0f} s run to measure")
    kept = [r for r in result.records if r.arrival_s >= warmup_s]
    return dataclasses.replace(result, records=kept, elapsed_s=result.elapsed_s - warmup_s)


def _target(args: argparse.Namespace, policy: str, scale: _SloScale) -> TargetBundle:
    from engine.scheduling import SLO

    given = scale.default_slo(args)
    slo = SLO(*given) if given else None
    if _is_sim(args):
        return sim_target(args, policy, slo)
    if args.target != "inproc":
        raise ValueError(f"unknown target {args.target!r}: inproc, sim or http://HOST:PORT")
    return inproc_target(args, policy, slo)


def _install_policy(bundle: TargetBundle, policy: str, cfg) -> None:
    """Give a policy that takes default RT SLOs the run's (scaled) ones, and the target's cost
    model; built after calibration because `--slo-scale auto` is known only then."""
    from engine.scheduling import SLO, make_policy
    from loadgen.factory import policy_options
    from loadgen.workloads.build import rt_profile

    slo = rt_profile(cfg).slo
    target = bundle.target
    schedulers = (
        [target.engine.scheduler] if hasattr(target, "engine") else [w.scheduler for w in target.workers.values()]
    )
    # the simulator's policies plan with its planning model, never the truth (sim/planning.py)
    cost = getattr(getattr(target, "engine", None), "cost_model", None) or getattr(target, "planning_cost", None)
    opts = policy_options(policy, cost, SLO(slo.ttft_s, slo.tpot_s), bundle.policy_flags)
    if "default_slo" in opts:
        for scheduler in schedulers:
            scheduler.policy = make_policy(policy, **opts)


def _search(args: argparse.Namespace, policy: str, scale: _SloScale):
    """Bisect the rate; with `--decide-early` a probe stops once it is certain to miss the target
    (its attainment is then recorded as an upper bound; `MissBound`)."""
    stop_below = args.attainment if getattr(args, "decide_early", False) else None
    stopped: list[float] = []

    def attainment_at(rate: float) -> float:
        res = run_once(args, policy, scale, rate, progress=False, stop_below=stop_below)
        if res.stopped_early:
            stopped.append(rate)
            att = res.attainment_at_most
            _log(f"{policy}: rate {rate:.3f} -> SLO attainment at most {att:.3f} (stopped at {res.elapsed_s:.0f} s)")
            return att
        att = summarize(res.records, res.elapsed_s)["rt"]["slo_attainment"]
        _log(f"{policy}: rate {rate:.3f} -> SLO attainment {att}")
        return att or 0.0

    max_rate = getattr(args, "max_rate", None) or 1024.0
    found = effective_throughput(attainment_at, args.attainment, start=max(args.rate, 1e-3), max_rate=max_rate)
    found.stopped_early = stopped
    return found


class _SloScale:
    """`--slo-scale`: a number, or `auto` (measured once on the first in-process engine, or
    from the simulator's cost model; see loadgen/calibrate.py)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.auto = str(args.slo_scale).lower() == "auto"
        self.fixed = None if self.auto else _positive(args.slo_scale)
        self.detail: dict | None = None

    def value(self, bundle: TargetBundle | None) -> float:
        if not self.auto:
            return self.fixed
        if self.detail is None:
            self.detail = self._measure(bundle)
        return self.detail["slo_scale"]

    def default_slo(self, args: argparse.Namespace):
        """The RT SLO handed to policies that want a default (TTFT, TPOT), in seconds."""
        if not self.auto and args.slo_ttft is not None and args.slo_tpot is not None:
            return (args.slo_ttft, args.slo_tpot)
        return None

    def _measure(self, bundle: TargetBundle | None) -> dict:
        from loadgen import calibrate

        if bundle is None:
            _log("--slo-scale auto needs an inproc or sim target; using 1.0 over HTTP")
            return {"slo_scale": 1.0, "note": "http target: not measured"}
        target = bundle.target
        if hasattr(target, "engine"):
            step = calibrate.measure_engine_step_s(target.engine)
        else:
            step = calibrate.model_step_s(next(iter(target.workers.values())).cost)
        detail = calibrate.slo_scale(step)
        _log(
            f"SLO scale {detail['slo_scale']:.2f} (decode step {step * 1e3:.1f} ms here vs "
            f"{detail['reference_step_s'] * 1e3:.1f} ms on {detail['reference_profile']})"
        )
        return detail


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"--slo-scale must be a number or 'auto', got {text!r}") from None
    if v <= 0:
        raise ValueError(f"--slo-scale must be > 0, got {v}")
    return v


def _config(args: argparse.Namespace, policies: list[str], scale: _SloScale) -> dict:
    cfg = {k: v for k, v in vars(args).items() if k != "func" and not callable(v)}
    cfg["policies"] = policies
    cfg["slo_scale_detail"] = scale.detail
    cfg["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return cfg


def _is_sim(args: argparse.Namespace) -> bool:
    return args.target == "sim"


def _is_http(args: argparse.Namespace) -> bool:
    return str(args.target).startswith(("http://", "https://"))


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
