"""Where an acknowledged produce's time goes in the stack (issue 21, ninth session).

Run from the repository root: `python -m loadgen.bench.ack_probe ROUNDS PER_ROUND [JSON]`. In the
stack a produce's ack (`send_and_wait`, acks=all, linger 0) cost ~1.5 ms p50 on a quiet host;
alone, in `tandem bench kafka`, 0.2 ms. This probe starts its own tansu broker and times the
same send → ack with one thing added at a time, the conditions interleaved round by round so
load drifts hit them alike:

- `alone`: one producer, its event loop otherwise idle, the broker otherwise idle;
- `loop_readers`: as many awake token-path readers on the producer's own event loop as a
  service holds (`--readers`, fetching every 2 ms on topics nobody writes): the sender task and
  the readers' fetch answers share one loop (and the GIL);
- `broker_readers`: the same readers in another process: the broker answers their fetches
  while it handles the produce, the producer's loop is idle;
- `loop_lag`: no readers; a second task keeps the producer's loop busy in slices of
  `--slice-us` (another request's work: decoding, spans, placement), as a service's loop is.

Each send also records the loop's own latency (`call_soon` → run, just before the send), which
tells the loop's part from the broker's. Records are spaced 2-8 ms apart. The figures and what
they decided are in docs/services.md ("Issue 21, ninth session").
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import statistics
import subprocess
import sys
import time

CONDITIONS = ("alone", "loop_readers", "broker_readers", "loop_lag")


async def _readers(bootstrap: str, n: int, prefix: str) -> list:
    """`n` aiokafka consumers that keep a 2 ms fetch in flight on empty topics (awake readers)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from shared.kafka import KafkaClient
    from shared.settings import ServiceSettings
    from shared.topics import TopicSpec

    admin = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap), f"{prefix}-admin")
    topics = [TopicSpec(f"{prefix}-{i}", 1, "none") for i in range(n)]
    await admin.ensure_topics(topics)
    out = []
    for t in topics:
        c = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, fetch_max_wait_ms=2)
        await c.start()
        c.assign([TopicPartition(t.name, 0)])
        out.append(c)
    return out


async def _drain(readers: list, stop: asyncio.Event) -> None:
    async def one(c):
        while not stop.is_set():
            await c.getmany(timeout_ms=50)

    await asyncio.gather(*(one(c) for c in readers))


def _child_readers(bootstrap: str, n: int, ready, stop) -> None:
    """Another process's awake readers (the stack's other services), until `stop` is set."""
    import uvloop

    async def main():
        readers = await _readers(bootstrap, n, "child")
        ready.set()
        flag = asyncio.Event()

        async def watch():
            while not stop.is_set():
                await asyncio.sleep(0.05)
            flag.set()

        await asyncio.gather(_drain(readers, flag), watch())
        for c in readers:
            await c.stop()

    uvloop.run(main())


async def _loop_lag() -> float:
    """Seconds from `call_soon` to the callback running: the event loop's own latency now."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    t0 = time.perf_counter()
    loop.call_soon(lambda: done.done() or done.set_result(time.perf_counter() - t0))
    return await done


async def _busy_slices(stop: asyncio.Event, slice_us: int) -> None:
    """Hold the loop for `slice_us` at a time, yielding between slices (a service's own work)."""
    while not stop.is_set():
        end = time.perf_counter() + slice_us / 1e6
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(0)


async def _probe(bootstrap: str, rounds: int, per_round: int, n_readers: int, slice_us: int) -> dict:
    from shared.kafka import KafkaClient
    from shared.schemas.control import Cancel, ControlEnvelope
    from shared.settings import ServiceSettings
    from shared.topics import TopicSpec

    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap), "ack-probe")
    await kafka.start([TopicSpec("ack-probe", 1, "none")])
    msg = ControlEnvelope(message=Cancel(request_id="x"))
    own = await _readers(bootstrap, n_readers, "own")
    ctx = mp.get_context("spawn")
    samples = {c: {"ack_ms": [], "loop_ms": []} for c in CONDITIONS}
    for _ in range(rounds):
        for cond in CONDITIONS:
            stop = asyncio.Event()
            side: list[asyncio.Task] = []
            child = None
            if cond == "loop_readers":
                side.append(asyncio.create_task(_drain(own, stop)))
            elif cond == "loop_lag":
                side.append(asyncio.create_task(_busy_slices(stop, slice_us)))
            elif cond == "broker_readers":
                ready, child_stop = ctx.Event(), ctx.Event()
                child = ctx.Process(target=_child_readers, args=(bootstrap, n_readers, ready, child_stop))
                child.start()
                while not ready.is_set():
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.05)  # the condition settles (readers have fetches in flight)
            for _ in range(per_round):
                await asyncio.sleep(random.uniform(0.002, 0.008))
                samples[cond]["loop_ms"].append(await _loop_lag() * 1000)
                t0 = time.perf_counter()
                await kafka.send("ack-probe", msg)
                samples[cond]["ack_ms"].append((time.perf_counter() - t0) * 1000)
            stop.set()
            await asyncio.gather(*side)
            if child is not None:
                child_stop.set()
                await asyncio.to_thread(child.join)
    for c in own:
        await c.stop()
    await kafka.stop()
    out = {}
    for cond, s in samples.items():
        ack = sorted(s["ack_ms"])
        out[cond] = {
            "n": len(ack),
            "ack_p50_ms": statistics.median(ack),
            "ack_p90_ms": ack[int(0.9 * len(ack))],
            "loop_lag_p50_ms": statistics.median(s["loop_ms"]),
            "loop_lag_p90_ms": sorted(s["loop_ms"])[int(0.9 * len(ack))],
        }
        o = out[cond]
        print(
            f"{cond:15} n={o['n']} ack p50 {o['ack_p50_ms']:.3f} p90 {o['ack_p90_ms']:.3f} ms;"
            f" loop lag p50 {o['loop_lag_p50_ms']:.3f} p90 {o['loop_lag_p90_ms']:.3f} ms",
            flush=True,
        )
    return out


def main(argv: list[str]) -> int:
    import argparse

    import uvloop

    from loadgen.bench.common import write_json
    from loadgen.provenance import stamp
    from services.broker import start_broker

    ap = argparse.ArgumentParser(prog="python -m loadgen.bench.ack_probe")
    ap.add_argument("rounds", type=int)
    ap.add_argument("per_round", type=int)
    ap.add_argument("json", nargs="?")
    ap.add_argument("--readers", type=int, default=3, help="awake readers (a worker holds dispatch, control, more)")
    ap.add_argument("--slice-us", type=int, default=300, help="the loop_lag condition's busy slice")
    a = ap.parse_args(argv)
    proc, bootstrap = start_broker(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        conditions = uvloop.run(_probe(bootstrap, a.rounds, a.per_round, a.readers, a.slice_us))
    finally:
        proc.terminate()
        proc.wait()
    result = {
        "rounds": a.rounds,
        "per_round": a.per_round,
        "readers": a.readers,
        "slice_us": a.slice_us,
        "conditions": conditions,
        "provenance": stamp().as_dict(),
    }
    write_json(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
