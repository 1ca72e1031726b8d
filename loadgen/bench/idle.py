"""`tandem bench idle`: what the whole stack costs while it serves nothing.

Starts `tandem up` (embedded broker, scheduler, advisory, worker(s), queue, gateway) with a tiny
random-weight model, waits until the gateway is ready plus `--settle` seconds (group joins,
compacted topics replayed, the model warm), then reads the CPU time (user + system) of every
process in the `tandem up` tree at the start and at the end of `--seconds` with no request at
all. The result is per process and in total, as a share of one core: 100% = one core busy.

The issue's goal is under 5% of one core for the whole tree. On a shared machine the figure
includes the cost of being descheduled (nothing else), so it is a fair upper bound; `--repeat`
runs the window several times on the same stack and reports each, so the spread is visible.

`--against DIR` is the A/B for a busy machine: a second stack runs at the same time from the code
in DIR (e.g. `git archive <commit> | tar -x -C DIR`), and every window measures both trees over
the same seconds, so the load of the machine weighs on both alike. The load average is recorded
at the start and the end of every window (`load_avg`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time

import psutil

from loadgen.bench.common import write_json
from loadgen.provenance import stamp


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("idle", help="CPU the whole `tandem up` tree uses with no requests")
    p.add_argument("--model", default="tiny", help="'tiny' (random 2-layer Llama), 'default', or a path")
    p.add_argument("--seconds", type=float, default=30.0, help="length of one measurement window")
    p.add_argument("--repeat", type=int, default=3, help="windows measured back to back on the same stack")
    p.add_argument("--settle", type=float, default=5.0, help="seconds to wait after the gateway is ready")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--against", default=None, help="a checkout of other code: run its stack alongside, same windows")
    p.add_argument("--json", default=None, help="write results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvloop

    from loadgen.bench.gateway import _tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_model(tmp) if args.model == "tiny" else args.model
        result = uvloop.run(_bench(args, model))
    result["provenance"] = stamp(dtype="float32").as_dict()
    _print(result)
    write_json(result, args.json)
    return 0


async def _bench(args, model: str) -> dict:
    from loadgen.bench.stack import running_stack

    windows, against = [], []
    async with contextlib.AsyncExitStack() as stacks:
        await stacks.enter_async_context(running_stack(model, workers=args.workers))
        if args.against:
            await stacks.enter_async_context(running_stack(model, workers=args.workers, checkout=args.against))
        await asyncio.sleep(args.settle)  # the quiet period is what is measured, not an event
        root = _up_process(os.getcwd())
        other = _up_process(args.against) if args.against else None
        for _ in range(args.repeat):
            load_before = os.getloadavg()
            measured = await asyncio.gather(*(measure_tree(p, args.seconds) for p in (root, other) if p))
            load = {"start": [round(x, 2) for x in load_before], "end": [round(x, 2) for x in os.getloadavg()]}
            for w in measured:
                w["load_avg"] = load
            windows.append(measured[0])
            if other is not None:
                against.append(measured[1])
    result = {"model": args.model, "workers": args.workers, "seconds": args.seconds, **_summary(windows)}
    if args.against:
        result["against"] = {"checkout": os.path.abspath(args.against), **_summary(against)}
    result["goal_core_pct"] = 5.0
    return result


def _summary(windows: list[dict]) -> dict:
    totals = [w["total_core_pct"] for w in windows]
    return {"windows": windows, "total_core_pct_min": min(totals), "total_core_pct_max": max(totals)}


def _up_process(checkout: str) -> psutil.Process:
    """The `tandem up` child `running_stack` started from `checkout` (its working directory)."""
    where = os.path.realpath(checkout)
    ups = [c for c in psutil.Process().children() if "up" in c.cmdline()[3:4] and os.path.realpath(c.cwd()) == where]
    if len(ups) != 1:
        raise RuntimeError(f"expected one `tandem up` child in {where}, found {len(ups)}")
    return ups[0]


def _cpu_seconds(p: psutil.Process) -> float | None:
    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return None


def process_label(p: psutil.Process) -> str:
    """`broker`, `scheduler`, `worker` ... from the command line (`python -m services.cli NAME`)."""
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return "gone"
    if cmd and cmd[0].endswith("tansu"):
        return "broker"
    if "services.cli" in cmd:
        rest = cmd[cmd.index("services.cli") + 1 :]
        if rest:
            if rest[0] == "worker" and "--worker-id" in rest:
                return rest[rest.index("--worker-id") + 1]
            return rest[0]
    return " ".join(cmd[:2])


async def measure_tree(root: psutil.Process, seconds: float) -> dict:
    """CPU seconds each process of `root`'s tree spent over `seconds`, as % of one core."""
    procs = [root, *root.children(recursive=True)]
    before = {p.pid: _cpu_seconds(p) for p in procs}
    t0 = time.monotonic()
    await asyncio.sleep(seconds)  # the measured window
    elapsed = time.monotonic() - t0
    per = {}
    for p in procs:
        end, start = _cpu_seconds(p), before[p.pid]
        if end is None or start is None:
            continue
        label = process_label(p) if p.pid != root.pid else "up"
        per[label] = round(100.0 * (end - start) / elapsed, 3)
    return {"seconds": round(elapsed, 3), "core_pct": per, "total_core_pct": round(sum(per.values()), 3)}


def _print(r: dict) -> None:
    print(f"idle stack, {r['workers']} worker(s), model {r['model']}, {len(r['windows'])} windows of {r['seconds']}s")
    _print_windows("this checkout", r)
    if "against" in r:
        _print_windows(r["against"]["checkout"], r["against"])
    print(f"goal < {r['goal_core_pct']}% of one core")


def _print_windows(label: str, r: dict) -> None:
    for i, w in enumerate(r["windows"]):
        parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(w["core_pct"].items()))
        load = w["load_avg"]["start"][0]
        print(f"{label} window {i}: total {w['total_core_pct']:.1f}% of one core ({parts}; load {load:.2f})")
    print(f"{label} total: {r['total_core_pct_min']:.1f}-{r['total_core_pct_max']:.1f}% of one core")
