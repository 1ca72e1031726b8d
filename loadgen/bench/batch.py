"""`tandem bench batch`: batch (BE) throughput and what a running batch does to RT latency.

On one CPU worker (`tandem up`, default model), three phases on the same stack:
  1. RT alone: Poisson chat requests at `--rt-rate` for `--rt-seconds`; TTFT p50/p99.
  2. Batch alone: one batch job of `--items` chat items; BE requests completed per second.
  3. Both: the same batch again with the same RT load running until it completes; BE rate and
     RT TTFT p50/p99 while the batch runs.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import time

from loadgen.bench.common import percentile, write_json
from loadgen.provenance import decided_dtype, stamp


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="batch throughput with and without RT load, and RT TTFT with and without a batch")
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--items", type=int, default=48)
    p.add_argument("--item-max-tokens", type=int, default=32)
    p.add_argument("--rt-rate", type=float, default=1.0, help="RT requests per second (Poisson)")
    p.add_argument("--rt-max-tokens", type=int, default=32)
    p.add_argument("--rt-seconds", type=float, default=30.0, help="duration of the RT-only phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvloop

    result = uvloop.run(_bench(args))
    result["provenance"] = stamp(dtype=decided_dtype(args.dtype)).as_dict()
    _print(result)
    write_json(result, args.json)
    return 0


async def _bench(args) -> dict:
    import httpx

    from loadgen.bench.stack import running_stack

    async with running_stack(args.model, dtype=args.dtype, kv_cache_gib=1.0) as (url, name):
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            for i in range(3):  # warm-up: first-request costs stay out of the figures
                await _rt_one(client, name, args, -1 - i, [])
            rt_alone = await _rt_load(client, name, args, stop=_after(args.rt_seconds))
            be_alone = await _run_batch(client, name, args)
            done = asyncio.Event()
            rt_task = asyncio.create_task(_rt_load(client, name, args, stop=done.wait))
            be_with_rt = await _run_batch(client, name, args)
            done.set()
            rt_with_be = await rt_task
    return {
        "model": args.model,
        "dtype": args.dtype,
        "items": args.items,
        "item_max_tokens": args.item_max_tokens,
        "rt_rate": args.rt_rate,
        "rt_max_tokens": args.rt_max_tokens,
        "rt_alone": rt_alone,
        "batch_alone": be_alone,
        "batch_with_rt": be_with_rt,
        "rt_with_batch": rt_with_be,
    }


def _after(seconds: float):
    async def wait():
        await asyncio.sleep(seconds)

    return wait


async def _rt_load(client, model: str, args, stop) -> dict:
    """Poisson RT chat requests until `stop()` returns; TTFT of each."""
    rng = random.Random(args.seed)
    ttfts: list[float] = []
    tasks = []
    stopper = asyncio.create_task(stop())
    i = 0
    while not stopper.done():
        tasks.append(asyncio.create_task(_rt_one(client, model, args, i, ttfts)))
        i += 1
        await asyncio.wait({stopper}, timeout=rng.expovariate(args.rt_rate))
    await asyncio.gather(*tasks)
    return {"requests": len(ttfts), "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}


async def _rt_one(client, model: str, args, i: int, ttfts: list[float]) -> None:
    body = {
        "model": model,
        "stream": True,
        "temperature": 0,
        "max_tokens": args.rt_max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": f"Question {i}: tell me something about the sea."}],
    }
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - t0
    if first is not None:
        ttfts.append(first)


async def _run_batch(client, model: str, args) -> dict:
    lines = [
        json.dumps(
            {
                "custom_id": f"item-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "temperature": 0,
                    "max_tokens": args.item_max_tokens,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Summarise document {i}: the quick brown fox jumps."}],
                },
            }
        )
        for i in range(args.items)
    ]
    data = ("\n".join(lines) + "\n").encode()
    f = (
        await client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("bench.jsonl", io.BytesIO(data))})
    ).json()
    t0 = time.perf_counter()
    batch = (
        await client.post(
            "/v1/batches",
            json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        )
    ).json()
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        await asyncio.sleep(0.5)
        batch = (await client.get(f"/v1/batches/{batch['id']}")).json()
    elapsed = time.perf_counter() - t0
    done = batch["request_counts"]["completed"]
    return {
        "status": batch["status"],
        "completed": done,
        "failed": batch["request_counts"]["failed"],
        "seconds": elapsed,
        "be_requests_per_s": done / elapsed,
    }


def _print(r: dict) -> None:
    ms = lambda v: "-" if v is None else f"{v * 1e3:.0f} ms"  # noqa: E731
    print(
        f"model {r['model']} ({r['dtype']}), one CPU worker; batch of {r['items']} items x {r['item_max_tokens']} "
        f"tokens; RT Poisson {r['rt_rate']}/s x {r['rt_max_tokens']} tokens"
    )
    for name in ("batch_alone", "batch_with_rt"):
        b = r[name]
        print(
            f"{name:14} {b['be_requests_per_s']:.2f} BE req/s ({b['completed']} done in {b['seconds']:.1f} s, "
            f"status {b['status']})"
        )
    for name in ("rt_alone", "rt_with_batch"):
        v = r[name]
        print(f"{name:14} TTFT p50 {ms(v['ttft_p50_s'])}, p99 {ms(v['ttft_p99_s'])} ({v['requests']} requests)")
