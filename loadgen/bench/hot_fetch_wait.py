"""The token path's fetch wait, probed: send -> an awake (hot) reader has the record.

Run from the repository root: `python -m loadgen.bench.hot_fetch_wait ROUNDS PER_ROUND [JSON]`. Starts
its own tansu broker and, per variant, a `KafkaClient` that sends and a hot `QuietConsumer`
that reads, records spaced 2-8 ms apart (engine steps). The variants run interleaved, round by
round, so load drifts hit them alike: fetch wait 2 ms or 1 ms, each with and without the early
sleep (`settle_early`) on the hot reader. Prints latency percentiles and the CPU of this
process (producer and reader) and of the broker per variant's wall time. The figures of the
sixth session are `docs/results/cplane/s6-hot-fetch-wait-probe.json` (docs/services.md, "Token-path
fetch wait 1 ms"). `tandem bench kafka` measures one hop and the producer settings; this probe
is the one that compares fetch waits on a hot reader.
"""

from __future__ import annotations

import asyncio
import random
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.kafka import KafkaClient
    from shared.quiet_consumer import QuietConsumer

# (name, fetch wait in ms, kafka_hot_settle)
VARIANTS = (("wait2", 2, False), ("wait1", 1, False), ("wait2_settle", 2, True), ("wait1_settle", 1, True))


@dataclass
class Variant:
    """One variant's client, reader and topic, and what it measured so far."""

    kafka: KafkaClient
    reader: QuietConsumer
    topic: str
    latencies_ms: list[float] = field(default_factory=list)
    cpu_s: float = 0.0  # this process's CPU time
    wall_s: float = 0.0
    broker_cpu_s: float = 0.0


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _probe(bootstrap: str, broker, rounds: int, per_round: int) -> dict:
    from shared.kafka import KafkaClient
    from shared.schemas.control import Cancel, ControlEnvelope
    from shared.settings import ServiceSettings
    from shared.topics import TopicSpec

    def broker_cpu_s() -> float:
        t = broker.cpu_times()
        return t.user + t.system

    msg = ControlEnvelope(message=Cancel(request_id="x"))
    variants: dict[str, Variant] = {}
    for name, wait_ms, settle in VARIANTS:
        settings = ServiceSettings(kafka_bootstrap=bootstrap, kafka_fetch_wait_ms=wait_ms, kafka_hot_settle=settle)
        kafka = KafkaClient(settings, f"p-{name}")
        topic = f"hot-{name}"
        await kafka.start([TopicSpec(topic, 1, "none")])
        reader = await kafka.consumer(group=None, hot=True)
        await kafka.assign_all(reader, topic, from_end=True)
        variants[name] = Variant(kafka, reader, topic)
    for _ in range(rounds):
        for v in variants.values():
            cpu0, wall0, broker0 = _own_cpu_s(), time.perf_counter(), broker_cpu_s()
            for _ in range(per_round):
                await asyncio.sleep(random.uniform(0.002, 0.008))  # an engine step between tokens
                t0 = time.perf_counter()
                await v.kafka.send(v.topic, msg)
                while not await v.reader.getmany(timeout_ms=2000):
                    pass
                v.latencies_ms.append((time.perf_counter() - t0) * 1000)
            v.cpu_s += _own_cpu_s() - cpu0
            v.wall_s += time.perf_counter() - wall0
            v.broker_cpu_s += broker_cpu_s() - broker0
    out = {}
    for name, v in variants.items():
        lat = sorted(v.latencies_ms)
        n = len(lat)
        out[name] = {
            "n": n,
            "p50_ms": lat[n // 2],
            "p90_ms": lat[int(0.9 * n)],
            "p99_ms": lat[int(0.99 * n)],
            "client_cpu_pct": v.cpu_s / v.wall_s * 100,
            "broker_cpu_pct": v.broker_cpu_s / v.wall_s * 100,
        }
        o = out[name]
        print(
            f"{name:14} n={n} p50={o['p50_ms']:.2f} p90={o['p90_ms']:.2f} p99={o['p99_ms']:.2f} ms"
            f"  cpu client {o['client_cpu_pct']:.1f}% broker {o['broker_cpu_pct']:.1f}% of a core",
            flush=True,
        )
        await v.kafka.stop()
    return out


def main(argv: list[str]) -> int:
    import psutil
    import uvloop

    from loadgen.bench.common import write_json
    from loadgen.provenance import stamp
    from services.broker import start_broker

    if len(argv) not in (2, 3):
        print("usage: python -m loadgen.bench.hot_fetch_wait ROUNDS PER_ROUND [JSON]", file=sys.stderr)
        return 2
    rounds, per_round = int(argv[0]), int(argv[1])
    proc, bootstrap = start_broker(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        variants = uvloop.run(_probe(bootstrap, psutil.Process(proc.pid), rounds, per_round))
    finally:
        proc.terminate()
        proc.wait()
    result = {"rounds": rounds, "per_round": per_round, "variants": variants, "provenance": stamp().as_dict()}
    if len(argv) == 3:
        write_json(result, argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
