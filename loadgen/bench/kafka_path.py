"""`tandem bench kafka`: one Kafka hop on the embedded broker, and the producer settings.

Starts its own tansu broker and measures, with `--samples` records each:

- `hop`: send → a consumer of `shared/kafka.py` has the record, for a consumer that is awake
  (records flowing, fetching every `kafka_fetch_wait_ms`) and one that sleeps (no fetch in
  flight; woken by the producer's doorbell), and for the plain 2 ms-polling consumer services
  used before (`TANDEM_KAFKA_LONG_POLL` off, no doorbell: `fetch_max_wait_ms=2`);
- `produce`: send → ack (`send_and_wait`) for acks all/1 and linger 0/1/5 ms.

Records are spaced by `--gap-ms` so each one finds the consumer in the state measured.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import time

from loadgen.bench.common import percentile, write_json
from loadgen.provenance import stamp


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kafka", help="latency of one Kafka hop and of producer settings on the embedded broker")
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--json", default=None, help="write results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvloop

    from services.broker import start_broker

    proc, bootstrap = start_broker(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        result = uvloop.run(_bench(bootstrap, args.samples))
    finally:
        proc.kill()
        proc.wait()
    result["provenance"] = stamp().as_dict()
    for section in ("hop", "produce"):
        for name, v in result[section].items():
            print(f"{section:8}{name:28} p50 {v['p50_s'] * 1e3:7.2f} ms  p99 {v['p99_s'] * 1e3:7.2f} ms")
    write_json(result, args.json)
    return 0


def _summary(xs: list[float]) -> dict:
    return {"p50_s": percentile(xs, 50), "p99_s": percentile(xs, 99), "n": len(xs)}


async def _bench(bootstrap: str, n: int) -> dict:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    from shared.kafka import KafkaClient
    from shared.schemas.control import Cancel, ControlEnvelope
    from shared.settings import ServiceSettings
    from shared.topics import TopicSpec

    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap), "bench")
    topics = [TopicSpec(t, 1, "none") for t in ("bk-awake", "bk-asleep", "bk-plain", "bk-produce")]
    await kafka.start(topics)
    msg = ControlEnvelope(message=Cancel(request_id="x"))

    async def hop(topic: str, consumer, gap_s: float) -> list[float]:
        out = []
        for _ in range(n):
            await asyncio.sleep(gap_s)  # the state measured: awake (short gap) or asleep (long)
            t0 = time.perf_counter()
            await kafka.send(topic, msg)
            while not await consumer.getmany(timeout_ms=2000):
                pass
            out.append(time.perf_counter() - t0)
        return out

    hops = {}
    awake = await kafka.consumer(group=None, hot=True)
    await kafka.assign_all(awake, "bk-awake", from_end=True)
    hops["quiet_consumer_awake"] = _summary(await hop("bk-awake", awake, 0.005))
    asleep = await kafka.consumer(group=None, hot=True)
    await kafka.assign_all(asleep, "bk-asleep", from_end=True)
    hops["quiet_consumer_woken_by_ring"] = _summary(await hop("bk-asleep", asleep, 0.15))
    plain = AIOKafkaConsumer(bootstrap_servers=bootstrap, fetch_max_wait_ms=2, enable_auto_commit=False)
    await plain.start()
    tp = TopicPartition("bk-plain", 0)
    plain.assign([tp])
    await plain.seek_to_end(tp)
    hops["plain_2ms_poll"] = _summary(await hop("bk-plain", plain, 0.15))
    await plain.stop()

    produce = {}
    for acks in ("all", 1):
        for linger in (0, 1, 5):
            p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks=acks, linger_ms=linger)
            await p.start()
            xs = []
            for _ in range(n):
                t0 = time.perf_counter()
                await p.send_and_wait("bk-produce", msg.encode())
                xs.append(time.perf_counter() - t0)
            await p.stop()
            produce[f"acks={acks},linger_ms={linger}"] = _summary(xs)
    await kafka.stop()
    return {"samples": n, "hop": hops, "produce": produce}
