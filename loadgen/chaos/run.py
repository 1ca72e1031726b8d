"""`tandem chaos`: SIGKILL each service type in turn, and in pairs, under steady RT streams and
running batch jobs, and count what was lost, duplicated or garbled and how long recovery took.

One round per fault and repeat: submit a batch job, let traffic run `settle_s`, SIGKILL the
fault's processes, start them again after `restart_delay_s` (the harness is the supervisor:
loadgen/chaos/stack.py says why), and measure recovery: from the kill to the first small
request that succeeds (`clients.recovery_s`). The next round starts once both gateways count
both workers again. After the last round the RT clients stop, every job is waited for and
counted, and the result (JSON, with the provenance stamp) holds per-fault recovery p50/p99 and
the totals. Bad numbers are reported as they are; the command fails only if it could not run.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loadgen.bench.common import percentile
from loadgen.chaos import batches, clients
from loadgen.chaos.stack import FAULT_TARGETS, ChaosStack

SINGLE = ("gateway", "scheduler", "queue", "advisory", "worker", "broker")
PAIRS = ("scheduler+queue", "gateway+worker", "advisory+scheduler", "broker+scheduler")


@dataclass(frozen=True)
class ChaosConfig:
    faults: tuple[str, ...]  # kinds, or pairs "a+b"
    repeats: int
    rt_clients: int = 2
    rt_max_tokens: int = 24
    batch_items: int = 24
    batch_max_tokens: int = 32
    ha: bool = False  # scheduler, advisory and queue as active/standby pairs (stack.py)
    settle_s: float = 2.0
    restart_delay_s: float = 1.0
    retry_budget_s: float = 120.0
    recovery_timeout_s: float = 180.0
    ready_timeout_s: float = 600.0
    batch_timeout_s: float = 600.0


@dataclass
class FaultRecord:
    fault: str
    repeat: int
    killed_at: float
    killed: list[str]  # the children it killed (with HA: the active of a pair at that moment)
    recovery_s: float | None
    ready_again_s: float | None  # until both gateways counted both workers again
    crashed: list[str]  # children found dead that the harness had not killed
    # the recovery probe's requests that took over a second or failed, and the one that succeeded
    # (request ids the services log: docs/reliability.md, "Tracing a slow recovery")
    probes: list[clients.ProbeAttempt] = field(default_factory=list)


def targets(fault: str) -> list[str]:
    names = []
    for kind in fault.split("+"):
        if kind not in FAULT_TARGETS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_TARGETS)}")
        names += FAULT_TARGETS[kind]
    return names


async def run_chaos(cfg: ChaosConfig, model: str, log_dir: Path) -> dict:
    for fault in cfg.faults:
        targets(fault)  # a bad name fails before anything starts
    stack = ChaosStack(model, log_dir, ha=cfg.ha)
    try:
        await asyncio.to_thread(stack.start, cfg.ready_timeout_s)
        return await _drive(cfg, stack)
    finally:
        await asyncio.to_thread(stack.stop)


async def _drive(cfg: ChaosConfig, stack: ChaosStack) -> dict:
    gateways = clients.Gateways(list(stack.gateways.values()))
    refs = await clients.references(gateways, cfg.rt_max_tokens)
    baseline = await _baseline_probe(gateways, cfg.recovery_timeout_s)
    stop = asyncio.Event()
    rt: list[clients.RTRecord] = []
    drivers = [
        asyncio.create_task(clients.rt_client(i, gateways, refs, cfg.rt_max_tokens, cfg.retry_budget_s, stop, rt))
        for i in range(cfg.rt_clients)
    ]
    jobs, faults = [], []
    try:
        for repeat in range(cfg.repeats):
            for fault in cfg.faults:
                jobs.append(await batches.submit(gateways, f"r{repeat}-{fault}", cfg.batch_items, cfg.batch_max_tokens))
                await asyncio.sleep(cfg.settle_s)
                faults.append(await _one_fault(cfg, stack, gateways, fault, repeat))
    finally:
        stop.set()
        await asyncio.wait(drivers, timeout=cfg.retry_budget_s + 30)
        for d in drivers:
            d.cancel()
    deadline = time.monotonic() + cfg.batch_timeout_s
    counts = [await batches.count(gateways, bid, ids, deadline) for bid, ids in jobs]
    return {"baseline_probe_s": baseline, **_summary(cfg, faults, rt, counts), "deposed": list(stack.deposed)}


async def _baseline_probe(gateways: clients.Gateways, timeout_s: float, n: int = 5) -> float | None:
    """A probe's own latency with nothing killed (median of `n`): a recovery time is never
    below it, and on a busy machine it is not small."""
    times = []
    for _ in range(n):
        t = await clients.recovery_s(gateways, time.time(), timeout_s)
        if t is not None:
            times.append(t)
    return percentile(times, 50)


async def _one_fault(
    cfg: ChaosConfig, stack: ChaosStack, gateways: clients.Gateways, fault: str, repeat: int
) -> FaultRecord:
    names = [name for kind in fault.split("+") for name in stack.targets(kind)]
    crashed = [n for n in stack.dead() if n not in names]
    killed_at = time.time()
    for name in names:
        await asyncio.to_thread(stack.kill, name)
    probes: list[clients.ProbeAttempt] = []
    tag = f"probe-{fault.replace('+', '-')}-r{repeat}-{int(killed_at)}"
    recovery = asyncio.create_task(clients.recovery_s(gateways, killed_at, cfg.recovery_timeout_s, probes, tag))
    await asyncio.sleep(cfg.restart_delay_s)
    for name in names:
        await asyncio.to_thread(stack.spawn, name)
    for name in crashed:  # restarted too, so one crash does not spoil every later round
        await asyncio.to_thread(stack.spawn, name)
    recovered = await recovery
    try:
        await asyncio.to_thread(stack.wait_ready, cfg.ready_timeout_s)
        ready_again = time.time() - killed_at
    except RuntimeError:
        ready_again = None
    notable = [p for p in probes if p.error is None or p.took_s > 1.0]  # the fast refusals add nothing
    return FaultRecord(fault, repeat, killed_at, names, recovered, ready_again, crashed, notable)


def _summary(cfg: ChaosConfig, faults: list[FaultRecord], rt: list[clients.RTRecord], counts) -> dict:
    per_fault = {}
    for fault in cfg.faults:
        recs = [f for f in faults if f.fault == fault]
        times = [f.recovery_s for f in recs if f.recovery_s is not None]
        per_fault[fault] = {
            "repeats": len(recs),
            "recovered": len(times),
            "recovery_p50_s": percentile(times, 50) if times else None,
            "recovery_p99_s": percentile(times, 99) if times else None,
            "recovery_s": [f.recovery_s for f in recs],
            "ready_again_s": [f.ready_again_s for f in recs],
        }
    done = [r for r in rt if r.finished]
    return {
        "config": asdict(cfg),
        "faults": per_fault,
        "rt": {
            "requests": len(done),
            "ok": sum(r.outcome == "ok" for r in done),
            "lost": sum(r.outcome == "lost" for r in done),
            "gaps_or_repeats": sum(r.outcome == "mismatch" for r in done),
            "retried": sum(r.attempts > 1 for r in done),
            "attempts": sum(r.attempts for r in done),
            "unfinished_at_stop": len(rt) - len(done),
            "error_kinds": _error_kinds(done),
        },
        "batch": {
            "jobs": len(counts),
            "items": sum(c.items for c in counts),
            "ok": sum(c.ok for c in counts),
            "failed": sum(c.failed for c in counts),
            "lost": sum(c.lost for c in counts),
            "duplicated": sum(c.duplicated for c in counts),
            "not_completed": [asdict(c) for c in counts if c.status != "completed"],
        },
        "rt_lost": [_lost_record(r, faults) for r in done if r.outcome != "ok"],
        "crashed": sorted({n for f in faults for n in f.crashed}),
        "rounds": [asdict(f) for f in faults],
    }


def _error_kinds(records: list[clients.RTRecord]) -> dict[str, int]:
    """How retried attempts failed, by the error's kind (the URL and details dropped)."""
    kinds: dict[str, int] = {}
    for r in records:
        for e in r.errors:
            kind = e.split(": ", 1)[-1][:80]
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _lost_record(r: clients.RTRecord, faults: list[FaultRecord]) -> dict:
    """A lost (or garbled) request with the faults whose kill fell while it was being tried, and
    `in_round`: the round whose stack was not ready again yet when the request started. A kill
    just before the request is not in `faults`: three of the eighth session's five losses under
    load (chaos-s8-r2.json) had it empty, sent 3.5 s after an advisory+scheduler kill. So every
    loss can be put down to the fault that caused it."""
    during = [f"{f.fault}#{f.repeat}" for f in faults if r.started - 1.0 <= f.killed_at <= r.finished]
    return {**asdict(r), "faults": during, "in_round": _round_at(r.started, faults)}


def _round_at(t: float, faults: list[FaultRecord]) -> str | None:
    """The round in effect at `t`: killed at or before it and not ready again by then (a round
    that never got ready again counts until the next kill)."""
    for f in sorted(faults, key=lambda f: f.killed_at, reverse=True):
        if f.killed_at <= t:
            ready = f.ready_again_s
            return f"{f.fault}#{f.repeat}" if ready is None or t <= f.killed_at + ready else None
    return None
