"""`python -m loadgen.sim.bros_trace`: where BE throughput goes in a simulated RT + BE run —
memory or time? (docs/bros.md, "Why BE loses throughput").

Runs `tandem sim`'s own fair setup (same options, same planning model, noise and swap space)
for each policy on one seed and logs every step: the RT and BE tokens it carried, how many
BE requests were outstanding, resident, on host or not yet admitted, the blocks each class
held, and for `bros` why each BE request left out was left out (`Decision.be_no_memory` /
`be_no_time`). It then sums the simulated time up by what held BE back:

- `be_tokens_per_s`: BE tokens computed per second of simulated time;
- `time_be_out_*`: seconds during which some outstanding BE request did not run, split by the
  first reason that applies — `host` (some BE request had KV on host), `memory` (the policy
  found no KV for it), `time` (the time budget or the batch cap), `other` (baselines, whose
  reasons are not recorded);
- `time_be_tail`: seconds when fewer than a quarter of a BE batch were outstanding (the
  workload refills only when the whole batch is done, so a straggler idles the backlog);
- `step_s_mean` and `fixed_cost_share`: how long steps were and which part of the simulated
  time was the profile's per-step fixed cost (β), which smaller steps pay more often;
- `rt_latency_parts`: RT normalised latency split into its TTFT part (mean of TTFT / output
  tokens) and its decode part (mean of (finish − first token) / output tokens), with the mean
  and p90 gap between RT tokens: where RT latency is (docs/bros.md, "Fourth pass").

Writes one JSON document with the provenance stamp (`--json`). `--windows S` adds, per run,
the steps summed up over windows of S seconds of simulated time (`windows`: what each class
computed and threw away, blocks held, BE requests on host), which is how the rate-3 starvation
was read (docs/bros.md, "Fourth pass"); `--summarize FILE` computes them from a JSON written
with `--steps` and keeps that file's provenance.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class StepLog:
    """One simulated step, as the trace sees it."""

    start_s: float
    duration_s: float
    rt_tokens: int
    be_tokens: int
    be_rows: int
    be_outstanding: int  # BE requests submitted and not finished
    be_on_host: int  # admitted BE requests with KV on host
    be_unadmitted: int  # BE requests waiting for their first step
    blocks_rt: int
    blocks_be: int
    free_blocks: int
    be_no_memory: int  # bros only: BE left out for want of KV
    be_no_time: int  # bros only: BE left out for want of time or a seat
    be_swapped_out: int  # BE requests moved to host by this step
    be_dropped_tokens: int  # computed BE tokens thrown away by recompute preemption this step
    rt_dropped_tokens: int
    swap_s: float  # host-link time of the step's copies (overlapped with the pass on a GPU profile)
    exec_s: float  # the cost model's forward-pass time for the step, without copies or noise
    rows: int = 0  # requests in the step
    decode_rows: int = 0  # of which decode rows (one new token)
    # device blocks held by requests that do not run this step: BE with KV on host (they
    # cannot run until restored), other BE, and RT (memory the step does not turn into tokens)
    blocks_be_parked: int = 0
    blocks_be_idle: int = 0
    blocks_rt_idle: int = 0
    # what the step's RT decode rows waited for: the cost model's time of the step with its RT
    # rows alone, and with the BE decode rows added (the rest of `exec_s` is BE prefill chunks)
    rt_decode_rows: int = 0
    exec_rt_s: float = 0.0
    exec_rt_be_decode_s: float = 0.0
    be_checkpointed_slots: int = 0  # BE slots RT growth copied to host (lazy checkpointing)
    be_head_host_blocks: int = 0  # host blocks of the oldest outstanding BE request


def trace(args: argparse.Namespace, policy: str) -> dict:
    from engine.scheduling import RequestClass
    from loadgen.driver import Driver
    from loadgen.factory import workload_config
    from loadgen.metrics import summarize
    from loadgen.orchestrate import _install_policy, _SloScale, _target
    from loadgen.sim.step_time import swap_bytes
    from loadgen.workloads.build import build_workload

    scale = _SloScale(args)
    bundle = _target(args, policy, scale)
    cfg = workload_config(args, max_len=bundle.max_len, slo_scale=scale.value(bundle), rate=args.rate)
    _install_policy(bundle, policy, cfg)
    (worker,) = bundle.target.workers.values()
    kv, scheduler = worker.kv, worker.scheduler
    logs: list[StepLog] = []
    start_step = worker.start_step

    def logged(now: float) -> float | None:
        computed = {r: r.num_computed_tokens for r in scheduler.running}
        duration = start_step(now)
        if duration is None:
            return None
        be = RequestClass.BE
        items = worker.batch.items
        dropped = {c: sum(computed.get(r, 0) for r in worker.batch.preempted if r.req_class is c) for c in RequestClass}
        live = [*scheduler.running, *scheduler.waiting]
        in_batch = {it.request for it in items}
        idle = [r for r in scheduler.running if r not in in_batch]
        held = {c: sum(kv.device_blocks(r) for r in scheduler.running if r.req_class is c) for c in RequestClass}
        decision = getattr(scheduler.policy, "last", None)
        logs.append(
            StepLog(
                now,
                duration,
                sum(it.num_new_tokens for it in items if it.request.req_class is not be),
                sum(it.num_new_tokens for it in items if it.request.req_class is be),
                sum(1 for it in items if it.request.req_class is be),
                sum(1 for r in live if r.req_class is be),
                sum(1 for r in scheduler.running if r.req_class is be and not kv.is_resident(r)),
                sum(1 for r in scheduler.waiting if r.req_class is be and not kv.holds(r)),
                held[RequestClass.RT],
                held[be],
                kv.pool.num_free,
                len(getattr(decision, "be_no_memory", ())),
                len(getattr(decision, "be_no_time", ())),
                sum(1 for r in worker.batch.swapped_out if r.req_class is be),
                dropped[be],
                dropped[RequestClass.RT],
                swap_bytes(worker.batch, worker.spec.kv_bytes_per_token) / worker.cost.swap_bytes_per_s,
                worker.cost.estimate(*_rows(worker.batch), 0),
                len(items),
                sum(1 for it in items if it.num_new_tokens == 1),
                sum(kv.device_blocks(r) for r in scheduler.running if r.req_class is be and not kv.is_resident(r)),
                sum(kv.device_blocks(r) for r in idle if r.req_class is be and kv.is_resident(r)),
                sum(kv.device_blocks(r) for r in idle if r.req_class is not be),
                *_rt_wait(items, worker.cost),
                sum(len(c.src_slots) for c in worker.batch.copies if c.reason == "checkpoint"),
                _head_host_blocks(kv, live),
            )
        )
        return duration

    worker.start_step = logged
    workload = build_workload(cfg)
    result = Driver(bundle.target, workload, bundle.prompts, drain_timeout_s=args.drain_timeout).run()
    bundle.target.close()
    summary = summarize(result.records, result.elapsed_s)
    return {
        "policy": policy,
        "rt_normalized_latency_s": summary["rt"]["normalized_latency_s"],
        "rt_latency_parts": rt_latency_parts(result.records),
        "rt_step_parts": rt_step_parts(logs),
        "be_throughput_rps": summary["be"]["throughput_rps"],
        **_account(logs, args.be_batch or 16, worker.cost),
        # tokens finished requests took from the prefix cache: at their first admission (0 for
        # rt-be's unrelated prompts), and when re-admitted after a recompute preemption (a
        # dropped request whose blocks were still cached pays little for it)
        "prompt_tokens_cached": worker.prompt_tokens_cached,
        "recompute_tokens_cached": worker.recompute_tokens_cached,
        "steps": [asdict(s) for s in logs] if args.steps or args.windows else None,
    }


def rt_latency_parts(records) -> dict:
    """RT normalised latency (mean of e2e / output tokens) = `ttft_part_s` + `decode_part_s`
    over completed RT requests, plus the gaps between their tokens (`RequestRecord`s)."""
    done = [r for r in records if r.req_class == "rt" and r.finish_s is not None and r.token_times_s]
    gaps = sorted(b - a for r in done for a, b in zip(r.token_times_s, r.token_times_s[1:]))
    return {
        "ttft_part_s": _mean([(r.token_times_s[0] - r.arrival_s) / len(r.token_times_s) for r in done]),
        "decode_part_s": _mean([(r.finish_s - r.token_times_s[0]) / len(r.token_times_s) for r in done]),
        "gap_mean_s": _mean(gaps),
        "gap_p90_s": gaps[int(0.9 * (len(gaps) - 1))] if gaps else 0.0,
    }


def _rt_wait(items, cost) -> tuple[int, float, float]:
    """`StepLog.rt_decode_rows`, `exec_rt_s` and `exec_rt_be_decode_s` of one step's items."""
    from engine.scheduling import RequestClass
    from loadgen.sim.step_time import batch_rows

    rt = [it for it in items if it.request.req_class is not RequestClass.BE]
    be_decode = [it for it in items if it.request.req_class is RequestClass.BE and it.num_new_tokens == 1]
    rt_rows = sum(1 for it in rt if it.num_new_tokens == 1)
    return rt_rows, cost.estimate(*batch_rows(rt), 0), cost.estimate(*batch_rows(rt + be_decode), 0)


def _head_host_blocks(kv, live) -> int:
    from engine.scheduling import RequestClass

    be = [r for r in live if r.req_class is RequestClass.BE and kv.holds(r)]
    return kv.num_host_blocks(min(be, key=lambda r: r.arrival_time)) if be else 0


def rt_step_parts(logs: list[StepLog]) -> dict:
    """The step an RT decode row waits for, averaged per RT decode row (seconds): its whole
    duration and that split by the cost model into the step RT's rows alone would take, what
    BE's decode rows add and what BE's prefill chunks add (scaled to the step's duration, so
    the parts add up to it: noise and copies are shared out in proportion). Which of BE's work
    RT's decode part is made of (docs/bros.md, "Seventh pass")."""
    rows = sum(s.rt_decode_rows for s in logs) or 1
    parts = dict.fromkeys(("step_s", "rt_alone_s", "be_decode_rows_s", "be_prefill_s"), 0.0)
    for s in logs:
        if not s.rt_decode_rows or s.exec_s <= 0:
            continue
        w, scale = s.rt_decode_rows / rows, s.duration_s / s.exec_s
        parts["step_s"] += w * s.duration_s
        parts["rt_alone_s"] += w * scale * s.exec_rt_s
        parts["be_decode_rows_s"] += w * scale * (s.exec_rt_be_decode_s - s.exec_rt_s)
        parts["be_prefill_s"] += w * scale * (s.exec_s - s.exec_rt_be_decode_s)
    return parts


def _rows(batch) -> tuple[list, list]:
    from loadgen.sim.step_time import batch_rows

    return batch_rows(batch.items)


def _account(logs: list[StepLog], be_batch: int, cost) -> dict:
    """Sum simulated time up by what held BE back (module docstring)."""
    span = sum(s.duration_s for s in logs) or 1.0
    out = dict.fromkeys(("time_be_out_host", "time_be_out_memory", "time_be_out_time", "time_be_out_other"), 0.0)
    tail = 0.0
    for s in logs:
        if s.be_outstanding < max(1, be_batch // 4):
            tail += s.duration_s
        if s.be_rows >= s.be_outstanding:
            continue
        if s.be_on_host:
            out["time_be_out_host"] += s.duration_s
        elif s.be_no_memory:
            out["time_be_out_memory"] += s.duration_s
        elif s.be_no_time:
            out["time_be_out_time"] += s.duration_s
        else:
            out["time_be_out_other"] += s.duration_s
    fixed = min(cost.prefill.beta, cost.decode.beta)
    return {
        "simulated_busy_s": span,
        "steps_count": len(logs),
        "be_tokens_per_s": sum(s.be_tokens for s in logs) / span,
        "rt_tokens_per_s": sum(s.rt_tokens for s in logs) / span,
        "step_s_mean": statistics.mean(s.duration_s for s in logs) if logs else 0.0,
        "fixed_cost_share": fixed * len(logs) / span,
        "time_with_be_in_batch": sum(s.duration_s for s in logs if s.be_rows) / span,
        "mean_be_rows_when_running": _mean([s.be_rows for s in logs if s.be_rows]),
        "mean_blocks_be": _mean([s.blocks_be for s in logs]),
        "mean_blocks_rt": _mean([s.blocks_rt for s in logs]),
        # time-weighted device blocks held by requests that did not run (see StepLog)
        "mean_blocks_be_parked": _time_mean(logs, "blocks_be_parked", span),
        "mean_blocks_be_idle": _time_mean(logs, "blocks_be_idle", span),
        "mean_blocks_rt_idle": _time_mean(logs, "blocks_rt_idle", span),
        "mean_free_blocks": _time_mean(logs, "free_blocks", span),
        "time_be_tail": tail,
        "swap_s": sum(s.swap_s for s in logs),
        "exec_s": sum(s.exec_s for s in logs),
        "steps_swap_bound": sum(1 for s in logs if s.swap_s > s.exec_s),
        "mean_rows": _mean([s.rows for s in logs]),
        "mean_decode_rows": _mean([s.decode_rows for s in logs]),
        "tokens_per_step": _mean([s.rt_tokens + s.be_tokens for s in logs]),
        "decode_token_share": sum(s.decode_rows for s in logs) / max(1, sum(s.rt_tokens + s.be_tokens for s in logs)),
        "be_swapped_out": sum(s.be_swapped_out for s in logs),
        "be_dropped_tokens_per_s": sum(s.be_dropped_tokens for s in logs) / span,
        "rt_dropped_tokens_per_s": sum(s.rt_dropped_tokens for s in logs) / span,
        "be_checkpointed_slots_per_s": sum(s.be_checkpointed_slots for s in logs) / span,
        "time_be_head_on_host": sum(s.duration_s for s in logs if s.be_head_host_blocks),
        **out,
    }


def windows(steps: list[dict], width_s: float) -> list[dict]:
    """Per-step logs (`StepLog` as dicts) summed up over windows of `width_s` simulated seconds:
    tokens per second computed and dropped by recompute preemption per class, mean blocks held
    per class and free, mean BE requests on host and not yet admitted, BE swap-outs, BE rows."""
    buckets: dict[int, list[dict]] = {}
    for s in steps:
        buckets.setdefault(int(s["start_s"] // width_s), []).append(s)
    return [_window(b * width_s, buckets[b]) for b in sorted(buckets)]


def _window(start_s: float, group: list[dict]) -> dict:
    span = sum(s["duration_s"] for s in group) or 1.0
    rates = ("rt_tokens", "be_tokens", "rt_dropped_tokens", "be_dropped_tokens")
    means = ("be_rows", "blocks_rt", "blocks_be", "free_blocks", "be_on_host", "be_unadmitted", "be_no_memory")
    return {
        "start_s": start_s,
        "steps": len(group),
        **{f"{k}_per_s": sum(s[k] for s in group) / span for k in rates},
        **{k: statistics.mean(s[k] for s in group) for k in means},
        "be_swapped_out": sum(s["be_swapped_out"] for s in group),
    }


def summarize_file(path: str, width_s: float) -> dict:
    """A `--steps` JSON with its steps replaced by their windows (its config and provenance kept)."""
    doc = json.loads(Path(path).read_text())
    for run in doc["runs"]:
        run["windows"] = windows(run.pop("steps") or [], width_s)
    doc["summarized_from"] = {"file": Path(path).name, "window_s": width_s}
    return doc


def _time_mean(logs: list[StepLog], name: str, span: float) -> float:
    return sum(getattr(s, name) * s.duration_s for s in logs) / span


def _mean(xs: list[float]) -> float:
    return statistics.mean(xs) if xs else 0.0


def main(argv: list[str] | None = None) -> int:
    from loadgen.cli import add_run_args
    from loadgen.provenance import stamp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, target_default="sim", workload_default="rt-be")
    ap.add_argument("--policies", default="fcfs-prefill-first,bros")
    ap.add_argument("--steps", action="store_true", help="keep every step's log in the JSON")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--windows", type=float, default=None, metavar="S", help="add per-window sums (S seconds)")
    ap.add_argument("--summarize", default=None, metavar="FILE", help="windows of a --steps JSON, to --json")
    args = ap.parse_args(argv)
    if args.summarize:
        doc = summarize_file(args.summarize, args.windows or 30.0)
        Path(args.json).write_text(json.dumps(doc, indent=2)) if args.json else print(json.dumps(doc, indent=2))
        return 0
    prov = stamp().as_dict()  # at the start: the code that runs is the code checked out now
    runs = []
    for policy in args.policies.split(","):
        runs.append(trace(args, policy))
        if args.windows:
            runs[-1]["windows"] = windows(runs[-1]["steps"] or [], args.windows)
            runs[-1]["steps"] = runs[-1]["steps"] if args.steps else None
        print(json.dumps({k: v for k, v in runs[-1].items() if k not in ("steps", "windows")}), flush=True)
    if args.json:
        doc = {"config": {k: v for k, v in vars(args).items()}, "runs": runs, "provenance": prov}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
