"""`tandem bench gateway`: what the Kafka path costs.

Runs the same requests one at a time (a) straight into an `AsyncLLM` built and run as the
worker under `tandem up` builds and runs it (a child process with the worker's settings, torch
threads, OpenMP wait policy and GIL switch interval: `loadgen/bench/inproc.py`) and (b) through
the full stack (`tandem up`: broker, scheduler, worker, gateway as separate processes) over
loopback HTTP/SSE, and reports the TTFT and inter-token latency each adds: the difference is
what gateway → Kafka → scheduler → worker → Kafka → gateway costs, and nothing else. Then it measures the request
rate the stack sustains with a trivial model (closed loop, one-token completions).
The model defaults to a tiny random-weight Llama (`--model tiny`) so model time is small and
the transport's share is visible; pass a path or `default` to measure with a real model.

Where the added time goes: the stack exports its traces to a receiver in this process
(`loadgen/otlp_sink.py`), each measured request carries its own `traceparent`, and `hops`
reports p50/p99 of every hop span (`shared/tracing.py`) of those requests, beside
`added_by_kafka_path`; `first_token_path` splits each request's TTFT into its Kafka hops (each
as the produce's ack and the reader's wake-up), the services' own work and what no span covers
(`loadgen/bench/hop_path.py`). The export itself (a batching thread per service) is part of what is
measured, as it is in a traced deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import time

from loadgen.bench.common import percentile, write_json
from loadgen.bench.hop_path import first_token_path, hop_breakdown
from loadgen.bench.inproc import PROMPT
from loadgen.otlp_sink import OtlpSink
from loadgen.provenance import stamp

_RECORDED_ENV = ("TANDEM_KAFKA_", "TANDEM_RT_GRANT")  # the settings an A/B of this bench varies


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gateway", help="latency the Kafka path adds, and the gateway's sustained request rate")
    p.add_argument("--model", default="tiny", help="'tiny' (random 2-layer Llama), 'default', or a path")
    p.add_argument("--requests", type=int, default=50, help="sequential requests per path")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rate-seconds", type=float, default=10.0, help="duration of the sustained-rate phase")
    p.add_argument("--concurrency", type=int, default=32, help="clients in the sustained-rate phase")
    p.add_argument("--json", default=None, help="write results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvloop

    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_model(tmp) if args.model == "tiny" else args.model
        result = uvloop.run(_bench(args, model))
    result["provenance"] = stamp(dtype="float32").as_dict()  # _bench's engine runs float32
    _print(result)
    write_json(result, args.json)
    return 0


def _tiny_model(tmp: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.loader import load_tokenizer, resolve_model

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    path = os.path.join(tmp, "tiny")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)
    load_tokenizer(resolve_model("default")).save_pretrained(path)
    return path


async def _bench(args, model: str) -> dict:
    inproc = await _inproc(args, model)
    stack = await _through_stack(args, model)
    added = {k: stack["sequential"][k] - inproc[k] for k in inproc if k.endswith("_s")}
    return {
        "model": args.model,
        # Kafka-layer and dispatch settings the stack inherits from this environment (an A/B of a
        # setting, e.g. TANDEM_KAFKA_HOT_SETTLE=true or TANDEM_RT_GRANTS=true, says which side this was)
        "kafka_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_RECORDED_ENV)},
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "inproc": inproc,
        "gateway": stack["sequential"],
        "added_by_kafka_path": added,
        "hops": stack["hops"],
        "first_token_path": stack["path"],
        "sustained": stack["sustained"],
    }


async def _inproc(args, model: str) -> dict:
    """The same requests into the worker's engine in a child process that runs as the worker
    under `tandem up` does (`loadgen/bench/inproc.py`): same settings, threads, OpenMP policy."""
    from loadgen.bench.inproc import child_env
    from services import lifeline
    from services.up import worker_threads

    env = child_env({k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"})
    argv = [sys.executable, "-m", "loadgen.bench.inproc", "--model", model, "--requests", str(args.requests)]
    argv += ["--max-tokens", str(args.max_tokens), "--num-threads", str(worker_threads(1))]
    proc = await asyncio.create_subprocess_exec(*argv, env=lifeline.tied_env(env), stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the in-process baseline failed (exit {proc.returncode})")
    r = json.loads(out.decode().strip().splitlines()[-1])
    return {**_latency(r["ttfts_s"], r["itls_s"]), "runtime": r["runtime"]}


async def _through_stack(args, model: str) -> dict:
    import httpx

    from loadgen.bench.stack import running_stack

    with OtlpSink() as sink:
        async with running_stack(model, env={"TANDEM_OTLP_ENDPOINT": sink.url}) as (url, name):
            # One connection per client of the sustained phase (httpx's default pool holds 100,
            # which would cap the concurrency the gateway sees).
            limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                seq, ttft_by_trace = await _sequential(client, url, name, args)
                sustained = await _sustained(client, url, name, args)
        # The stack has stopped: every service flushed its spans on the way out.
        spans = sink.spans()
    hops = hop_breakdown(spans, set(ttft_by_trace))
    return {"sequential": seq, "sustained": sustained, "hops": hops, "path": first_token_path(spans, ttft_by_trace)}


async def _sequential(client, url: str, model: str, args) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    ttfts, itls, ttft_by_trace = [], [], {}
    for i in range(args.requests + 3):
        trace_id = secrets.token_hex(16)
        times = await _stream_times(client, url, body, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
        if i >= 3:
            ttfts.append(times[0])
            itls += [b - a for a, b in zip(times, times[1:])]
            ttft_by_trace[trace_id] = times[0]
    return _latency(ttfts, itls), ttft_by_trace


async def _stream_times(client, url: str, body: dict, headers: dict | None = None) -> list[float]:
    """Seconds from sending to each content chunk (one chunk per engine step here)."""
    t0 = time.perf_counter()
    out = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line and '"content":""' not in line:
                out.append(time.perf_counter() - t0)
    return out


async def _sustained(client, url: str, model: str, args) -> dict:
    body = {"model": model, "prompt": "hi", "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    done, errors = 0, 0
    deadline = time.perf_counter() + args.rate_seconds

    async def loop():
        nonlocal done, errors
        while time.perf_counter() < deadline:
            r = await client.post(f"{url}/v1/completions", json=body)
            done, errors = done + (r.status_code == 200), errors + (r.status_code != 200)

    t0 = time.perf_counter()
    await asyncio.gather(*[loop() for _ in range(args.concurrency)])
    elapsed = time.perf_counter() - t0
    return {
        "requests": done,
        "errors": errors,
        "seconds": elapsed,
        "requests_per_s": done / elapsed,
        "concurrency": args.concurrency,
    }


def _latency(ttfts: list[float], itls: list[float]) -> dict:
    return {
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
    }


def _print(r: dict) -> None:
    ms = lambda v: f"{v * 1e3:8.2f}"  # noqa: E731
    print(f"model {r['model']}, {r['requests']} sequential requests of {r['max_tokens']} tokens")
    print(f"{'':14}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}  (ms)")
    for name in ("inproc", "gateway", "added_by_kafka_path"):
        v = r[name]
        print(f"{name:14}{ms(v['ttft_p50_s'])}  {ms(v['ttft_p99_s'])}  {ms(v['itl_p50_s'])}  {ms(v['itl_p99_s'])}")
    if r["hops"]:
        print(f"{'hop (first token)':24}{'p50':>8}{'p99':>8}  (ms)")
        for hop, v in r["hops"].items():
            print(f"{hop:24}{ms(v['p50_s'])}{ms(v['p99_s'])}")
    path = r["first_token_path"]
    if path["requests"]:
        print(f"first token's path, per request ({path['requests']} requests, {path['kafka_hops']} Kafka hops)")
        for part in ("kafka_s", "services_s", "untraced_s", "ttft_s"):
            print(f"  {part[:-2]:22}{ms(path[part]['p50_s'])}{ms(path[part]['p99_s'])}")
        for hop in (k[: -len(".ack_s")] for k in path if k.endswith(".ack_s")):
            ack, wake = path[f"{hop}.ack_s"], path[f"{hop}.wake_s"]
            print(f"  {hop:22}ack {ms(ack['p50_s'])}  wake-up {ms(wake['p50_s'])}  (p50)")
    s = r["sustained"]
    print(
        f"sustained: {s['requests_per_s']:.1f} req/s ({s['requests']} ok, {s['errors']} errors, "
        f"{s['concurrency']} clients, 1-token completions)"
    )
