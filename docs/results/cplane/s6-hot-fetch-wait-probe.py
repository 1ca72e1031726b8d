# Run from the repository root: python docs/results/cplane/s6-hot-fetch-wait-probe.py ROUNDS PER_ROUND
"""Probe for the gateway's result reader: send (KafkaClient, rings) -> hot QuietConsumer has it,
token-like gaps; variants interleaved round by round: fetch wait 2 ms / 1 ms, and 2 ms with the
early sleep (settle_early) on the hot reader. Also CPU seconds of this process per variant."""
import asyncio, random, resource, subprocess, sys, time
import uvloop
sys.path.insert(0, ".")
from services.broker import start_broker
from shared.kafka import KafkaClient
from shared.schemas.control import Cancel, ControlEnvelope
from shared.settings import ServiceSettings
from shared.topics import TopicSpec

import psutil
BROKER = None
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
def bcpu():
    t = BROKER.cpu_times(); return t.user + t.system

async def main(b, rounds, per_round):
    msg = ControlEnvelope(message=Cancel(request_id="x"))
    variants = {}
    for name, wait, settle in (("wait2", 2, False), ("wait1", 1, False), ("wait2_settle", 2, True), ("wait1_settle", 1, True)):
        k = KafkaClient(ServiceSettings(kafka_bootstrap=b, kafka_fetch_wait_ms=wait), f"p-{name}")
        t = f"hot-{name}"
        await k.start([TopicSpec(t, 1, "none")])
        c = await k.consumer(group=None, hot=True)
        c._settle_early = settle
        await k.assign_all(c, t, from_end=True)
        variants[name] = (k, c, t, [], [0.0, 0.0, 0.0])
    for r in range(rounds):
        for name, (k, c, t, lat, acc) in variants.items():
            c0, w0, b0 = cpu(), time.perf_counter(), bcpu()
            for i in range(per_round):
                await asyncio.sleep(random.uniform(0.002, 0.008))   # engine steps
                t0 = time.perf_counter()
                await k.send(t, msg)
                while not await c.getmany(timeout_ms=2000):
                    pass
                lat.append((time.perf_counter() - t0) * 1000)
            acc[0] += cpu() - c0; acc[1] += time.perf_counter() - w0; acc[2] += bcpu() - b0
    for name, (k, c, t, lat, acc) in variants.items():
        lat.sort(); n = len(lat)
        print(f"{name:14} n={n} p50={lat[n//2]:.2f} p90={lat[int(.9*n)]:.2f} p99={lat[int(.99*n)]:.2f} ms  cpu client {acc[0]/acc[1]*100:.1f}% broker {acc[2]/acc[1]*100:.1f}% of a core", flush=True)
        await k.stop()

proc, b = start_broker(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
BROKER = psutil.Process(proc.pid)
try: uvloop.run(main(b, int(sys.argv[1]), int(sys.argv[2])))
finally: proc.terminate()
