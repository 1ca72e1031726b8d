"""One Kafka hop on the embedded broker as a partition gets deeper (issue 20, session 10).

Why: `tandem bench sessions` ran several cells on one stack, and session 9's 8-user cells, run
after the 16-user ones, were slower than them in every mode. A stack's gateway reads its results
from one partition, and a worker puts one record batch there per engine step: a 5-minute 16-user
cell leaves tens of thousands. This probe fills one partition with one-record batches (as the
token path writes them) and measures, at each depth, send -> a consumer at the end has the
record, on that partition and on a fresh topic of the same broker (the control: same process,
same moment). Printed and written as JSON with provenance:

    python -m loadgen.bench.broker_depth --depths 0,10000,30000,60000 --json FILE

On tansu (in memory) the hop grows with the partition's depth while the fresh topic's stays at
~1 ms, and the produce's ack stays under a few ms: the fetch at the end is what gets slow.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time

from loadgen.bench.common import percentile, write_json
from loadgen.provenance import stamp


async def _bench(bootstrap: str, depths: list[int], samples: int) -> list[dict]:
    from aiokafka import AIOKafkaProducer

    from shared.kafka import KafkaClient
    from shared.schemas.control import Cancel, ControlEnvelope
    from shared.settings import ServiceSettings
    from shared.topics import TopicSpec

    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap), "depth-probe")
    await kafka.start([TopicSpec("deep", 1, "none")] + [TopicSpec(f"fresh{i}", 1, "none") for i in range(len(depths))])
    msg = ControlEnvelope(message=Cancel(request_id="x"))
    raw = msg.encode()
    # one record per batch, as the token path writes them (a step's deltas for one gateway)
    filler = AIOKafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=0, max_batch_size=len(raw) + 100)
    await filler.start()

    async def hops(topic: str) -> dict:
        consumer = await kafka.consumer(group=None, hot=True)
        await kafka.assign_all(consumer, topic, from_end=True)
        while await consumer.getmany(timeout_ms=300):
            pass
        hop, ack = [], []
        for _ in range(samples):
            await asyncio.sleep(0.005)  # each record finds the consumer fetching (awake)
            t0 = time.perf_counter()
            await kafka.send(topic, msg)
            ack.append(time.perf_counter() - t0)
            while not await consumer.getmany(timeout_ms=10_000):
                pass
            hop.append(time.perf_counter() - t0)
        await consumer.stop()
        return {
            "hop_p50_s": percentile(hop, 50),
            "hop_p90_s": percentile(hop, 90),
            "ack_p50_s": percentile(ack, 50),
            "load_average": os.getloadavg()[0],
        }

    rows, depth = [], 0
    try:
        for i, target in enumerate(depths):
            while depth < target:
                sent = [await filler.send("deep", raw) for _ in range(min(500, target - depth))]
                await asyncio.gather(*sent)
                depth += len(sent)
            deep = await hops("deep")
            rows.append({"depth_batches": depth, "topic": "deep", **deep})
            depth += samples
            rows.append({"depth_batches": 0, "topic": f"fresh{i}", **await hops(f"fresh{i}")})
            for r in rows[-2:]:
                print(
                    f"{r['topic']:7s} depth {r['depth_batches']:7d}  hop p50 {r['hop_p50_s'] * 1e3:8.2f} ms"
                    f"  p90 {r['hop_p90_s'] * 1e3:8.2f} ms  ack p50 {r['ack_p50_s'] * 1e3:6.2f} ms"
                    f"  load {r['load_average']:.1f}",
                    flush=True,
                )
    finally:
        await filler.stop()
        await kafka.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    import uvloop

    from services.broker import start_broker

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="0,10000,30000,60000", help="one-record batches in the partition")
    ap.add_argument("--samples", type=int, default=40, help="hops measured at each depth")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    depths = sorted(int(d) for d in args.depths.split(","))
    proc, bootstrap = start_broker(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, tied=True)
    try:
        rows = uvloop.run(_bench(bootstrap, depths, args.samples))
    finally:
        proc.kill()
        proc.wait()
    write_json({"samples": args.samples, "rows": rows, "provenance": stamp().as_dict()}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
