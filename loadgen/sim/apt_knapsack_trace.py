"""`python -m loadgen.sim.apt_knapsack_trace`: the `aptserve` knapsack's inputs, iteration by
iteration, summed up: why HIDDEN is (not) chosen (issue 17; docs/aptserve.md, "Why HIDDEN is
never chosen (ninth session)").

`KnapsackRecorder` wraps a policy's `schedule` (the simulator's or the engine's: it only reads
the `SchedulerState` it is given, before the policy acts) and records, per iteration, its type,
N (outstanding requests), ρ, and per candidate request its value `p`, KV blocks `m̄`, HIDDEN
blocks `h`, penalty `c = N·ρ·m̄` and SLO state. From these it counts, per iteration type, where
HIDDEN is *on the hull* (the knapsack could take it: worth more than its penalty and, where
KV fits too, `(p - c)/h >= p/m̄`, the paper's refinement; in the iteration's capacity: the
free blocks for a prefill, the pool for a decode), where it would be under the paper's *code*
(N less the requests past their SLO, `aptserve_scheduler.py`'s `_U -= num_violate`), where
the policy withholds it and where it is chosen, plus the value/penalty ratio's percentiles. It changes no decision.

The command runs one simulated worker at the paper's setup (as `policy_trace`) and prints one
JSON document with the provenance stamp.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field

from engine.kv.hidden import HiddenBlocks
from engine.scheduling.apt_values import make_candidate, request_value, slo_violated
from engine.scheduling.knapsack import options
from engine.scheduling.policy import SchedulerState


@dataclass
class KindStats:
    """One iteration type's counts (a candidate is a request the knapsack saw)."""

    iterations: int = 0
    memory_binds: int = 0  # iterations whose candidates' KV blocks exceed the capacity
    candidates: int = 0
    demoted: int = 0  # past their SLO: near-zero value, never HIDDEN under the paper's values
    multi_block: int = 0  # live (not demoted) candidates of more than one block: HIDDEN's domain
    hidden_on_hull: int = 0  # the knapsack could take HIDDEN (our N)
    hidden_on_hull_paper_n: int = 0  # ... with the paper's code's N (less the demoted)
    hidden_chosen: int = 0
    outstanding: list[int] = field(default_factory=list)
    outstanding_live: list[int] = field(default_factory=list)
    value_over_penalty: list[float] = field(default_factory=list)  # p / (N·ρ·m̄), live multi-block
    value_s: list[float] = field(default_factory=list)
    penalty_s: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "iterations": self.iterations,
            "memory_binds": self.memory_binds,
            "candidates": self.candidates,
            "demoted": self.demoted,
            "live_multi_block": self.multi_block,
            "hidden_on_hull": self.hidden_on_hull,
            "hidden_on_hull_paper_n": self.hidden_on_hull_paper_n,
            "hidden_chosen": self.hidden_chosen,
            "mean_outstanding": _mean(self.outstanding),
            "mean_outstanding_not_demoted": _mean(self.outstanding_live),
            # HIDDEN is on the hull iff p >= 2·N·ρ·m̄ for h = m̄/2: this ratio >= 2
            "value_over_penalty": _percentiles(self.value_over_penalty),
            "value_s": _percentiles(self.value_s),
            "penalty_s": _percentiles(self.penalty_s),
        }


class KnapsackRecorder:
    """Wraps `policy.schedule`; `summary()` after the run."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.kinds = {"prefill": KindStats(), "decode": KindStats()}
        self._inner = policy.schedule
        policy.schedule = self

    def __call__(self, state: SchedulerState):
        # read everything first: the policy admits, preempts and allocates as it goes
        before = self._inputs(state)
        waiting_ids = {r.request_id for r in state.waiting}
        hidden_before = self.policy.hidden_chosen
        batch = self._inner(state)
        if not batch:
            return batch
        kind = "prefill" if any(it.request.request_id in waiting_ids for it in batch.items) else "decode"
        stats = self.kinds[kind]
        stats.iterations += 1
        stats.hidden_chosen += self.policy.hidden_chosen - hidden_before
        outstanding, live_n, capacity, cands = before[kind]
        stats.outstanding.append(outstanding)
        stats.outstanding_live.append(live_n)
        stats.memory_binds += sum(m for _, m, _ in cands) > capacity
        rho, cap = self.policy.rho, capacity  # the knapsack's: free blocks (prefill), the pool (decode)
        for value, m, h in cands:
            stats.candidates += 1
            if value is None:
                stats.demoted += 1
                continue
            if h is None:
                continue
            stats.multi_block += 1
            penalty = outstanding * rho * m
            stats.value_s.append(value)
            stats.penalty_s.append(penalty)
            stats.value_over_penalty.append(value / penalty if penalty > 0 else float("inf"))
            stats.hidden_on_hull += _hidden_on_hull(value, m, h, outstanding, rho, cap)
            stats.hidden_on_hull_paper_n += _hidden_on_hull(value, m, h, live_n, rho, cap)
        return batch

    def _inputs(self, state: SchedulerState) -> dict:
        """Per iteration type: (N, N less the demoted, capacity, [(value or None if demoted,
        m̄, h or None where HIDDEN is not in question)]), the blocks as the policy counts them."""
        p = self.policy
        try:
            layout = state.kv.component(HiddenBlocks).layout
        except LookupError:
            layout = None
        hidden_ok = layout is not None and layout.saves_memory
        slo, now, bs = p.default_slo, state.now, state.kv.block_size
        everyone = [*state.waiting, *state.running]
        outstanding = len(everyone)
        live_n = outstanding - sum(1 for r in everyone if slo_violated(r, now, slo))
        limit = state.limits.max_num_batched_tokens

        def item(r, running: bool):
            extra = min(r.num_tokens - r.num_computed_tokens, limit) if running else 0
            m = max(1, -(-((r.num_computed_tokens + extra) if extra else r.num_tokens) // bs))
            if slo_violated(r, now, slo):
                return None, m, None
            return request_value(r, now, p.decay, slo), m, (layout.blocks_for(m) if hidden_ok and m > 1 else None)

        return {
            "prefill": (outstanding, live_n, state.kv.pool.num_free, [item(r, False) for r in state.waiting]),
            "decode": (outstanding, live_n, state.kv.pool.capacity, [item(r, True) for r in state.running]),
        }

    def summary(self) -> dict:
        return {kind: s.summary() for kind, s in self.kinds.items()}


def _hidden_on_hull(value: float, m: int, h: int, n: int, rho: float, capacity: int) -> bool:
    return any(c.hidden for _, _, c in options(make_candidate(value, m, h, n, rho), capacity))


def _mean(values) -> float | None:
    return statistics.fmean(values) if values else None


def _percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    s = sorted(values)

    def at(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))]

    return {"n": len(s), "p10": at(0.1), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": s[-1]}


def run(
    policy: str, rate: float, seed: int, requests: int, profile: str, max_num_seqs: int, rho: float | None = None
) -> dict:
    """One simulated run at the paper's setup (`policy_trace.trace`), the knapsack recorded."""
    from loadgen.sim.policy_trace import trace

    recorders: list[KnapsackRecorder] = []
    result = trace(
        policy,
        rate,
        seed,
        requests / rate,
        profile,
        rho,
        on_worker=lambda w: recorders.append(KnapsackRecorder(w.scheduler.policy)),
        max_num_seqs=max_num_seqs,
    )
    pol = recorders[0].policy
    return {
        **{
            k: result[k]
            for k in (
                *("policy", "rate", "seed", "slo_attainment", "ttft_attainment", "tbt_p99_attainment"),
                *("mean_decode_batch", "hidden_rows", "preemptions", "mean_step_s", "mean_rebuild_s_per_step"),
            )
        },
        "rho_s_per_block": pol.rho,
        "hidden_chosen": pol.hidden_chosen,
        "hidden_withheld": pol.hidden_withheld,
        "conversions": pol.conversions,
        "knapsack": recorders[0].summary(),
    }


def main(argv: list[str] | None = None) -> int:
    from loadgen.sim.policy_trace import write_runs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=1000, help="expected requests (the window is requests/rate)")
    ap.add_argument("--policies", default="aptserve", help="aptserve variants (policy_trace.VARIANTS)")
    ap.add_argument("--cost-model", default="opt-13b-a100-40gb")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the paper's vLLM 0.5 (the repro cells')")
    ap.add_argument("--rho", type=float, default=None, help="aptserve's ρ override, s per block")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    runs = []
    for policy in args.policies.split(","):
        runs.append(run(policy, args.rate, args.seed, args.requests, args.cost_model, args.max_num_seqs, args.rho))
        print(json.dumps(runs[-1]), flush=True)
    if args.out:
        write_runs(args.out, vars(args), runs)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
