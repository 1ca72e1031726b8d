"""`tandem bench sessions`: multi-turn chat with and without kept KV (Symphony, issue 6).

Each mode runs its own stack (`tandem up --workers 2`) and the same closed-loop sessions
workload at several user counts: every user holds one ShareGPT-like session at a time, reads
each answer and types the next prompt at human speeds (sped up by `--speedup` so a run takes
minutes, not hours), and starts a new session after the last turn.

Modes, compared in one run:
- `recompute`: no session ids and no prefix cache: every turn prefills the whole conversation,
  placed least-loaded (vLLM's default serving of multi-turn chat behind a load balancer).
- `sticky`: session ids, no hints: each turn goes to the worker holding the session's KV.
- `hints`: session ids plus typing hints: the advisory service places the coming turn by load
  and the target prefetches (or pulls) the KV while the user types.
- `load-aware` (issue 20): session ids, no hints, the default (advisory) routing: a turn goes
  to its holder while the holder has room, else least-loaded with the KV pulled or
  recomputed there. Against `hints` it isolates the hint's effect; against `sticky`, the
  load-aware routing's.
- `recompute-cached` (issue 20): as `recompute` but with the prefix cache on (what today's
  vLLM does behind a load balancer: a turn reuses its history only where it happens to land).

`--plan issue20` is the measurement plan of issue 20 (users 2, 4, 8, 16; all five modes;
5 minutes per cell); `--dry-run` prints a plan's cells and their time without running them.

Reported per mode and user count: the load generator's summary, next-turn (turn >= 1) TTFT
p50/p99 and TPOT, prompt tokens recomputed vs reused (from the OpenAI `usage` the gateway
returns), KV bytes moved between tiers and workers (the workers' session stats), and load
imbalance (max/mean of prefill tokens computed per worker). Then, per mode, the most users
whose next-turn p99 TTFT stays within `--ttft-p99-target`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass, field

from loadgen.bench.common import percentile, write_json
from loadgen.bench.gateway import _tiny_model
from loadgen.provenance import decided_dtype, stamp

# a p99 from fewer turns than this is the maximum of a handful, not a tail (issue 20: the
# earlier runs' p99s came from 7-25 samples); such cells are flagged, not dropped
MIN_P99_SAMPLES = 100


@dataclass(frozen=True)
class Mode:
    name: str
    session_ids: bool  # send X-Session-Id
    hints: bool  # send typing hints
    env: dict = field(default_factory=dict)  # settings for every service of the stack


MODES = {
    "recompute": Mode("recompute", False, False, {"TANDEM_ENABLE_PREFIX_CACHING": "false"}),
    "sticky": Mode("sticky", True, False, {"TANDEM_SESSION_ROUTING": "sticky"}),
    "hints": Mode("hints", True, True, {}),
    "load-aware": Mode("load-aware", True, False, {"TANDEM_SESSION_ROUTING": "advisory"}),
    "recompute-cached": Mode("recompute-cached", False, False, {}),
}

# named measurement plans: option overrides (issue 20: p99s need more than 7-25 samples, and
# the hint's effect must be separated from load-aware routing's)
PLANS = {
    "issue20": {
        "users": "2,4,8,16",
        "modes": "recompute,recompute-cached,sticky,load-aware,hints",
        "duration": 300.0,
    },
    # issue 20 on a busy 2-core host: >= 100 next turns behind each p99 in 2-minute cells. The
    # default model gives 7-25 next turns in 5 minutes here (a ~230-token answer at ~0.2 s per
    # token under load), so this plan measures the control-plane effect (routing, prefetch,
    # pulls, queueing) on the tiny model, with answers a quarter as long, 8 turns per session
    # and people 50x faster than life; `--model default` with the same options keeps one cell
    # on the real model (docs/sessions.md, session 8)
    "issue20-tiny": {
        "users": "4,8,16",
        "modes": "recompute,recompute-cached,load-aware,hints",
        "duration": 120.0,
        "model": "tiny",
        "length_scale": 0.25,
        "speedup": 50.0,
        "turns_mean": 8.0,
    },
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sessions", help="multi-turn sessions: recompute vs sticky vs typing hints with migration")
    p.add_argument("--duration", type=float, default=90.0, help="seconds per (mode, user count) run")
    p.add_argument("--users", default="2,4,8", help="comma-separated concurrent users (sessions) to sweep")
    p.add_argument("--modes", default="recompute,sticky,hints", help=f"some of {', '.join(MODES)}")
    p.add_argument(
        "--model",
        default="default",
        help="a model, or `tiny` (a random-weight 2-layer Llama with the default tokenizer: the control-plane "
        "effect at many turns per minute; its outputs mean nothing)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--kv-cache-gib", type=float, default=0.25)
    p.add_argument("--turns-mean", type=float, default=4.0)
    p.add_argument("--length-scale", type=float, default=1.0, help="scale ShareGPT prompt/output lengths")
    p.add_argument("--speedup", type=float, default=10.0, help="human reading/typing speed multiplier")
    p.add_argument("--ttft-p99-target", type=float, default=2.0, help="seconds: the latency bar for capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="keep each stack's log here")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plan", default=None, choices=sorted(PLANS), help="a named measurement plan (overrides options)")
    p.add_argument("--dry-run", action="store_true", help="print the cells and their time, run nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.plan:
        for key, value in PLANS[args.plan].items():
            setattr(args, key, value)
    if args.dry_run:
        print(plan_text(args))
        return 0
    import uvloop

    modes = [_mode(m) for m in args.modes.split(",") if m]
    levels = sorted({int(u) for u in args.users.split(",") if u})
    if not modes or not levels or min(levels) < 1:
        raise ValueError("need at least one mode and user counts >= 1")
    provenance = stamp(dtype=decided_dtype(args.dtype)).as_dict()
    with tempfile.TemporaryDirectory(prefix="tandem-sessions-model-") as tmp:
        model = _tiny_model(tmp) if args.model == "tiny" else args.model
        result = uvloop.run(_bench(args, modes, levels, provenance, model))
    print(format_result(result))
    write_json(result, args.json)
    return 0


def plan_text(args: argparse.Namespace) -> str:
    """The (mode, users) cells a run would measure, and the time they take (plus stack starts)."""
    modes = [_mode(m).name for m in args.modes.split(",") if m]
    levels = sorted({int(u) for u in args.users.split(",") if u})
    cells = [f"  {m:17s} users {u:3d}  {args.duration:.0f} s" for m in modes for u in levels]
    total = len(cells) * args.duration / 60
    return "\n".join([f"{len(cells)} cells, {total:.0f} minutes of load (one stack per mode):", *cells])


def _mode(name: str) -> Mode:
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
    return MODES[name]


async def _bench(
    args: argparse.Namespace,
    modes: list[Mode],
    levels: list[int],
    provenance: dict | None = None,
    model: str | None = None,
) -> dict:
    """Runs every (mode, users) cell. The JSON is rewritten after each cell with `complete`
    false: a 5-minute-per-cell grid takes hours on a shared host, and a run stopped part-way
    (SIGTERM, a deadline) must still leave every finished cell on disk. `model`: the path or name
    the stacks serve (default `args.model`; `run` builds the tiny model's folder)."""
    out: dict = {"config": {k: v for k, v in vars(args).items() if k != "func"}, "complete": False, "modes": {}}
    if provenance is not None:
        out["provenance"] = provenance

    def save_partial(name: str, runs: list[dict]) -> None:
        out["modes"][name] = {"levels": runs, "max_users_at_target": max_users_at(runs, args.ttft_p99_target)}
        write_json(out, getattr(args, "json", None))

    for mode in modes:
        out["modes"][mode.name] = await _run_mode(args, mode, levels, save_partial, model=model)
    out["comparison"] = compare_modes(out["modes"], args.ttft_p99_target)
    out["complete"] = True
    return out


async def _run_mode(
    args: argparse.Namespace, mode: Mode, levels: list[int], on_cell=None, *, model: str | None = None
) -> dict:
    from loadgen.bench.stack import running_stack

    with tempfile.TemporaryDirectory(prefix=f"tandem-sessions-{mode.name}-") as data_dir:
        env = {**mode.env, "TANDEM_DATA_DIR": data_dir}
        log = os.path.join(args.log_dir, f"sessions-{mode.name}.log") if args.log_dir else None
        async with running_stack(model or args.model, args.dtype, args.kv_cache_gib, log, args.workers, env) as (
            url,
            name,
        ):
            runs = []
            for users in levels:
                runs.append(await _run_level(args, mode, url, name, users))
                if on_cell is not None:
                    on_cell(mode.name, runs)
                print(f"  {mode.name:9s} users={users:3d}  {_one_line(runs[-1])}", flush=True)
    return {"levels": runs, "max_users_at_target": max_users_at(runs, args.ttft_p99_target)}


async def _run_level(args: argparse.Namespace, mode: Mode, url: str, name: str, users: int) -> dict:
    from loadgen.arrivals import ArrivalSpec
    from loadgen.metrics import summarize
    from loadgen.targets.http import HttpClient, HttpRun
    from loadgen.workloads.build import WorkloadConfig, build_workload
    from loadgen.workloads.sources import HumanSpeeds

    speeds = HumanSpeeds(250.0 * args.speedup, 40.0 * args.speedup)
    cfg = WorkloadConfig(
        "sessions",
        ArrivalSpec("closed", users=users),
        args.duration,
        seed=args.seed + users,
        length_scale=args.length_scale,
        turns_mean=args.turns_mean,
        speeds=speeds,
        max_len=2048,
    )
    workload = build_workload(cfg)
    client = HttpClient(url, name, send_session_ids=mode.session_ids)
    before = await worker_stats(client.client)
    load_before = os.getloadavg()  # the host is shared: every cell says how busy it was
    try:
        res = await HttpRun(client, workload, cfg.seed, None, False, send_hints=mode.hints).run()
        after = await worker_stats(client.client)
    finally:
        await client.close()
    level = {"users": users, "summary": summarize(res.records, res.elapsed_s)["rt"], "typing_hints": res.typing_hints}
    level["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    level.update(session_figures(res.records))
    level["kv_moved"] = stats_delta(before, after)
    return level


async def worker_stats(client) -> dict:
    """The gateway's view of every worker's session counters (`GET /v1/sessions/stats`)."""
    try:
        r = await client.get("/v1/sessions/stats")
        return r.json() if r.status_code == 200 else {}
    except Exception:  # noqa: BLE001 (older gateways: the bench still reports everything the client measures)
        return {}


def stats_delta(before: dict, after: dict) -> dict:
    """Counter growth during a run, summed over workers."""
    total: dict[str, float] = {}
    for worker, counters in (after.get("workers") or {}).items():
        base = (before.get("workers") or {}).get(worker, {})
        for key, value in counters.items():
            if isinstance(value, (int, float)):
                total[key] = total.get(key, 0) + value - base.get(key, 0)
    return total


def session_figures(records) -> dict:
    """Next-turn latency, recomputed vs reused prompt tokens, migrations and per-worker balance."""
    from loadgen.metrics import tpot, ttft

    done = [r for r in records if r.completed]
    later = [r for r in done if r.turn >= 1]
    prev = _previous_turn_workers(done)
    moved = [r for r in later if prev.get(r.request_id) not in (None, r.worker)]
    stayed = [r for r in later if prev.get(r.request_id) == r.worker]
    prompt = sum(r.usage_prompt_tokens or 0 for r in done)
    cached = sum(r.cached_tokens or 0 for r in done)
    return {
        "next_turn_requests": len(later),  # the turns behind the p99 below
        "p99_samples_ok": len(later) >= MIN_P99_SAMPLES,
        "next_turn_ttft_p50_s": percentile([ttft(r) for r in later], 50),
        "next_turn_ttft_p99_s": percentile([ttft(r) for r in later], 99),
        "next_turn_tpot_p50_s": percentile([v for v in (tpot(r) for r in later) if v is not None], 50),
        "first_turn_ttft_p50_s": percentile([ttft(r) for r in done if r.turn == 0], 50),
        "next_turn_same_worker": {"count": len(stayed), "ttft_p50_s": percentile([ttft(r) for r in stayed], 50)},
        "next_turn_moved_worker": {"count": len(moved), "ttft_p50_s": percentile([ttft(r) for r in moved], 50)},
        "failed": failures(records),
        "prompt_tokens": prompt,
        "prompt_tokens_reused": cached,
        "prompt_tokens_recomputed": prompt - cached,
        "per_worker": per_worker(done),
    }


def failures(records) -> dict[str, int]:
    """Turns that ended without completing, by cause: an overloaded stack answers 503
    `no_capacity` when no worker accepts a turn within the gateway's `first_event_timeout_s`
    (60 s), and a cell where every turn did has no latency to report, only this."""
    out: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            cause = r.error.split(":", 1)[0] if r.error.startswith("HTTP ") else "error"
            if "no_capacity" in r.error:
                cause += " no_capacity"
            out[cause] = out.get(cause, 0) + 1
    return out


def _previous_turn_workers(records) -> dict[str, str | None]:
    """request id -> the worker that served the same session's previous turn."""
    by_turn = {(r.session_id, r.turn): r.worker for r in records if r.session_id}
    return {r.request_id: by_turn.get((r.session_id, r.turn - 1)) for r in records if r.session_id}


def per_worker(records) -> dict:
    work: dict[str, dict] = {}
    for r in records:
        w = work.setdefault(r.worker or "?", {"requests": 0, "prefill_tokens": 0})
        w["requests"] += 1
        w["prefill_tokens"] += (r.usage_prompt_tokens or 0) - (r.cached_tokens or 0)
    loads = [w["prefill_tokens"] for w in work.values()]
    mean = sum(loads) / len(loads) if loads else 0
    return {"workers": work, "imbalance": (max(loads) / mean) if mean else None}


def max_users_at(levels: list[dict], target_s: float) -> int | None:
    """The most users whose next-turn p99 TTFT is within the target (None: not even the fewest)."""
    ok = [lv["users"] for lv in levels if (lv["next_turn_ttft_p99_s"] or float("inf")) <= target_s]
    return max(ok) if ok else None


def compare_modes(modes: dict, target_s: float) -> dict:
    """The issue's two goals: hinted next-turn TTFT vs on-device (sticky at the lowest load), and
    sessions held at the latency bar relative to recompute-every-turn."""
    out: dict = {"ttft_p99_target_s": target_s}
    hints, sticky, rec = modes.get("hints"), modes.get("sticky"), modes.get("recompute")
    if hints and sticky:
        h, s = hints["levels"][0]["next_turn_ttft_p50_s"], sticky["levels"][0]["next_turn_ttft_p50_s"]
        out["hint_vs_on_device_ttft_p50"] = (h / s) if h and s else None
    for name, mode in modes.items():
        out[f"{name}_max_users"] = mode["max_users_at_target"]
    if rec and hints and rec["max_users_at_target"] and hints["max_users_at_target"]:
        out["hints_vs_recompute_users"] = hints["max_users_at_target"] / rec["max_users_at_target"]
    return out


def _one_line(lv: dict) -> str:
    f = lambda v: "-" if v is None else f"{v * 1e3:.0f}ms"  # noqa: E731
    return (
        f"next-turn TTFT p50 {f(lv['next_turn_ttft_p50_s'])} p99 {f(lv['next_turn_ttft_p99_s'])}  "
        f"TPOT {f(lv['next_turn_tpot_p50_s'])}  recomputed {lv['prompt_tokens_recomputed']} / "
        f"{lv['prompt_tokens']} prompt tokens  imbalance {lv['per_worker']['imbalance'] or 0:.2f}"
    )


def format_result(res: dict) -> str:
    lines = [
        "| mode | users | next turns | next-turn TTFT p50 | p99 | TPOT p50 | recomputed / prompt tokens "
        "| pulled from peers | host/disk to device | written to disk | imbalance |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = lambda lv, *keys: f"{sum(lv['kv_moved'].get(k, 0) for k in keys) / 2**20:.1f} MiB"  # noqa: E731
    ms = lambda v: "-" if v is None else f"{v * 1e3:.0f} ms"  # noqa: E731
    for name, mode in res["modes"].items():
        for lv in mode["levels"]:
            thin = "" if lv.get("p99_samples_ok", True) else " (<100)"
            lines.append(
                f"| {name} | {lv['users']} | {lv['next_turn_requests']}{thin} | {ms(lv['next_turn_ttft_p50_s'])} | "
                f"{ms(lv['next_turn_ttft_p99_s'])} | {ms(lv['next_turn_tpot_p50_s'])} | "
                f"{lv['prompt_tokens_recomputed']} / {lv['prompt_tokens']} | {mib(lv, 'bytes_pulled')} | "
                f"{mib(lv, 'bytes_host_to_gpu', 'bytes_disk_to_gpu')} | {mib(lv, 'bytes_written_disk')} | "
                f"{lv['per_worker']['imbalance'] or 0:.2f} |"
            )
    lines.append("")
    lines.append(f"(<100): p99 from fewer than {MIN_P99_SAMPLES} next turns, the maximum of a handful, not a tail")
    lines.append(" ".join(f"{k}={v}" for k, v in res.get("comparison", {}).items()))
    return "\n".join(lines)
