"""`tandem bench loop-contention`: what Kafka work on a worker's event loop costs its engine's
first token (issue 21: `worker.first_token` was ~5 ms for a ~1 ms step on a quiet host).

One process, the worker's runtime (passive OpenMP, its GIL switch interval, its engine built from
`WorkerSettings`) and an embedded broker. Each request's first token is timed from the engine's
accept to its first delta on the event loop, in four modes interleaved request by request, so the
machine's load weighs on all of them alike:

- `quiet`: nothing else on the loop;
- `quiet+send`: one Kafka send (a small `ResultBatch`, acked) started at the accept, as the
  worker's `Accepted` and its dispatch commit were;
- `busy`: a token-path consumer awake (2 ms fetches) on the loop, as the worker's dispatch reader
  is for 50 ms after a dispatch;
- `busy+send`: both.

The difference between modes is the cost of that loop work on the engine's hop; the absolute
figures move with the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

from loadgen.bench.common import write_json
from loadgen.provenance import stamp

MODES = ("quiet", "quiet+send", "busy", "busy+send")
WARMUP = 8


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loop-contention", help="cost of Kafka work on the worker's loop to its first token")
    p.add_argument("--model", default="tiny", help="'tiny' (random 2-layer Llama) or a path")
    p.add_argument("--requests", type=int, default=80, help="requests per mode")
    p.add_argument("--json", default=None, help="write results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Re-run in a child with the environment `tandem up` gives its worker (passive OpenMP: this
    CLI's own default is active, fixed at torch's import)."""
    from loadgen.bench.inproc import child_env

    argv = [sys.executable, "-m", "loadgen.bench.loop_contention", "--model", args.model]
    argv += ["--requests", str(args.requests)] + (["--json", args.json] if args.json else [])
    env = child_env({k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"})
    return subprocess.run(argv, env=env, check=False).returncode


def _run_here(args: argparse.Namespace) -> int:
    import uvloop

    from loadgen.bench.gateway import _tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_model(tmp) if args.model == "tiny" else args.model
        load_before = os.getloadavg()
        result = uvloop.run(_measure(model, args.requests))
    result["load_avg"] = {"start": [round(x, 2) for x in load_before], "end": [round(x, 2) for x in os.getloadavg()]}
    result["provenance"] = stamp(dtype="float32").as_dict()
    for mode in MODES:
        r = result["first_token_ms"][mode]
        print(f"{mode:11s} first token p50 {r['p50']:.2f} ms, p90 {r['p90']:.2f} ms ({r['n']} requests)")
    print(f"load average {result['load_avg']['start'][0]:.2f} -> {result['load_avg']['end'][0]:.2f}")
    write_json(result, args.json)
    return 0


async def _measure(model: str, requests: int) -> dict:
    from engine import ChatPrompt, SamplingParams
    from engine.async_llm import AsyncLLM
    from services.broker import start_broker
    from services.up import worker_threads
    from services.worker.settings import WorkerSettings
    from shared.kafka import KafkaClient
    from shared.schemas.results import Accepted, ResultBatch
    from shared.topics import TopicSpec

    broker, bootstrap = start_broker(tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Consumers that never fall asleep by themselves: `busy` is the awake state, `quiet` pauses them.
    settings = WorkerSettings(
        model=model,
        dtype="float32",
        kv_cache_gib=0.25,
        num_threads=worker_threads(1),  # what `tandem up` gives its one worker
        kafka_bootstrap=bootstrap,
        kafka_awake_ms=10**9,
    )
    sys.setswitchinterval(settings.gil_switch_interval_s)  # as WorkerService.start does
    kafka = KafkaClient(settings, "loop-contention")
    await kafka.start([TopicSpec("contention", 1, "none")])
    consumer = await kafka.consumer(group=None, hot=True)
    (tp,) = await kafka.assign_all(consumer, "contention", from_end=True)
    reader = asyncio.create_task(_read_forever(consumer))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        with tempfile.TemporaryDirectory() as sessions:
            llm = AsyncLLM(settings.engine_config(sessions))
            await llm.start()
            params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
            prompt = await llm.encode(ChatPrompt([{"role": "user", "content": "Write one sentence about the sea."}]))
            batch = ResultBatch(source="w", events=[Accepted(request_id="x", worker_id="w", prompt_tokens=1)])
            for i in range(WARMUP + requests * len(MODES)):
                mode = MODES[i % len(MODES)]
                if mode.startswith("quiet"):
                    consumer.pause(tp)
                else:
                    consumer.resume(tp)
                await asyncio.sleep(0.03)  # settle into the mode (a pause takes effect on the next fetch)
                stream = await llm.add_request(f"r{i}", prompt, params)
                t0 = time.perf_counter()
                if mode.endswith("+send"):
                    asyncio.ensure_future(kafka.send("contention", batch, partition=0))
                async for _ in stream:
                    if i >= WARMUP:
                        times[mode].append((time.perf_counter() - t0) * 1000)
                    break
                stream.close()
            await llm.shutdown()
    finally:
        reader.cancel()
        await kafka.stop()
        broker.kill()
    return {"requests_per_mode": requests, "first_token_ms": {m: _summary(v) for m, v in times.items()}}


async def _read_forever(consumer) -> None:
    while True:
        await consumer.getmany(timeout_ms=1000)


def _summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered), 3),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
        "n": len(ordered),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--json", default=None)
    sys.exit(_run_here(ap.parse_args()))
