"""`tandem bench gateway-ab`: two or more stacks side by side, requests interleaved one by one.

`tandem bench gateway` runs one stack at a time, so on a shared machine an A/B of two code
states or settings compares different moments: at a load average of 20-30 its figures moved by
tens of milliseconds between back-to-back runs of the same code (tenth session). Here every
variant runs at once (each a `tandem up` stack with its own broker, started from this checkout
or another, with its own settings), and each round sends one streaming request to each
variant in turn (the order rotated every round), so they share every moment's load. It reports
each variant's TTFT and inter-token latency at the client, and against the first variant the
median of the per-round TTFT differences (paired: the same moment) and the difference of the
inter-token p50s. No in-process baseline: the "added by the Kafka path" figures are
`tandem bench gateway`'s, on a quiet machine. `--hops`: each stack exports its spans to its own
OTLP sink and each variant gets `tandem bench gateway`'s per-hop breakdown and first-token path
(loadgen/bench/hop_path.py), measured at the same moments as the other variants' (issue 21,
twelfth session).

A variant is `NAME[:KEY=VALUE,...][@CHECKOUT]`, e.g. `grants:TANDEM_RT_GRANTS=true`,
`queue:TANDEM_RT_GRANTS=false`, `main@/work/wt/main-copy`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import statistics
import tempfile
from dataclasses import dataclass, field

from loadgen.bench.common import percentile, write_json
from loadgen.bench.inproc import PROMPT


@dataclass
class Variant:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    checkout: str | None = None
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)  # the round of each TTFT (an error leaves a gap)
    errors: list[str] = field(default_factory=list)  # requests that failed or timed out (not in the figures)
    ttft_by_trace: dict[str, float] = field(default_factory=dict)  # with `--hops`
    hops: dict | None = None
    path: dict | None = None


def parse_variant(text: str) -> Variant:
    spec, _, checkout = text.partition("@")
    name, _, settings = spec.partition(":")
    env = dict(kv.split("=", 1) for kv in settings.split(",") if kv)
    return Variant(name, env, os.path.abspath(checkout) if checkout else None)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gateway-ab", help="stacks side by side, requests interleaved: a same-moment A/B")
    p.add_argument("--variant", action="append", required=True, help="NAME[:KEY=VALUE,...][@CHECKOUT]; 2 or more")
    p.add_argument("--model", default="tiny", help="'tiny' (random 2-layer Llama), 'default', or a path")
    p.add_argument("--rounds", type=int, default=50, help="measured rounds (one request per variant each)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take (then counted an error)")
    p.add_argument("--hops", action="store_true", help="per-hop breakdown per variant (spans to an OTLP sink each)")
    p.add_argument("--logs", default=None, help="a folder for each stack's `tandem up` log (NAME.log)")
    p.add_argument("--json", default=None, help="write results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvloop

    from loadgen.bench.gateway import _tiny_model
    from loadgen.provenance import stamp

    variants = [parse_variant(v) for v in args.variant]
    if len(variants) < 2 or len({v.name for v in variants}) != len(variants):
        raise SystemExit("give two or more variants with distinct names")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_model(tmp) if args.model == "tiny" else args.model
        uvloop.run(_bench(args, model, variants))
    result = summarise(variants, args)
    result["load_average_before"] = [round(x, 2) for x in load_before]
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    result["provenance"] = stamp(dtype="float32").as_dict()
    _print(result)
    write_json(result, args.json)
    return 0


async def _bench(args, model: str, variants: list[Variant]) -> None:
    import httpx

    from loadgen.bench.gateway import _stream_times
    from loadgen.bench.hop_path import first_token_path, hop_breakdown
    from loadgen.bench.stack import running_stack
    from loadgen.otlp_sink import OtlpSink

    sinks = [OtlpSink() if args.hops else None for _ in variants]
    async with contextlib.AsyncExitStack() as stacks:
        for sink in sinks:
            if sink is not None:
                stacks.enter_context(sink)  # closed after the stacks, which flush their spans on the way out
        # started one after another: starts are CPU-heavy and would starve each other's waits
        urls = []
        for v, sink in zip(variants, sinks):
            log = os.path.join(args.logs, f"{v.name}.log") if args.logs else None
            env = v.env if sink is None else {**v.env, "TANDEM_OTLP_ENDPOINT": sink.url}
            stack = running_stack(model, env=env, checkout=v.checkout, log_path=log)
            urls.append(await stacks.enter_async_context(stack))
        body = {
            "model": urls[0][1],
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        async with httpx.AsyncClient(timeout=args.timeout) as client:
            for i in range(args.rounds + 3):  # 3 warm-up rounds
                order = list(range(len(variants)))
                order = order[i % len(order) :] + order[: i % len(order)]
                for k in order:
                    trace_id = secrets.token_hex(16)
                    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"} if args.hops else None
                    try:
                        times = await _stream_times(client, urls[k][0], body, headers)
                    except httpx.HTTPError as exc:  # reported, not hidden: a stalled stream is a finding
                        variants[k].errors.append(f"round {i}: {exc!r}")
                        continue
                    if i >= 3 and times:
                        variants[k].ttfts.append(times[0])
                        variants[k].rounds.append(i)
                        variants[k].ttft_by_trace[trace_id] = times[0]
                        variants[k].itls += [b - a for a, b in zip(times, times[1:])]
    # The stacks stopped (flushing their spans on the way out) before their sinks, entered first.
    for v, sink in zip(variants, sinks):
        if sink is not None:
            spans = sink.spans()
            v.hops = hop_breakdown(spans, set(v.ttft_by_trace))
            v.path = first_token_path(spans, v.ttft_by_trace)


def summarise(variants: list[Variant], args) -> dict:
    first = variants[0]
    out = {"model": args.model, "rounds": args.rounds, "max_tokens": args.max_tokens, "variants": {}}
    for v in variants:
        row = {
            "env": v.env,
            "checkout": v.checkout,
            "requests": len(v.ttfts),
            "errors": v.errors,
            "ttft_p50_s": percentile(v.ttfts, 50),
            "ttft_p99_s": percentile(v.ttfts, 99),
            "itl_p50_s": percentile(v.itls, 50),
            "itl_p99_s": percentile(v.itls, 99),
            "ttfts_s": v.ttfts,  # with their rounds: any two variants can be paired afterwards
            "ttft_rounds": v.rounds,
        }
        if v.hops is not None:
            row["hops"], row["first_token_path"] = v.hops, v.path
        if v is not first and v.ttfts and first.ttfts:
            base = dict(zip(first.rounds, first.ttfts))  # paired by round: an error leaves its round out
            paired = [t - base[r] for r, t in zip(v.rounds, v.ttfts) if r in base]
            row[f"vs_{first.name}"] = {
                "ttft_paired_median_diff_s": statistics.median(paired),
                "ttft_p50_diff_s": row["ttft_p50_s"] - percentile(first.ttfts, 50),
                "itl_p50_diff_s": row["itl_p50_s"] - percentile(first.itls, 50),
            }
        out["variants"][v.name] = row
    return out


def _print(r: dict) -> None:
    def ms(x) -> str:
        return f"{x * 1000:8.2f}" if x is not None else "       -"

    print(f"{r['rounds']} rounds, one request per variant each, interleaved (load before {r['load_average_before']})")
    print(f"{'variant':12}{'TTFT p50':>9}{'TTFT p99':>9}{'ITL p50':>9}{'ITL p99':>9}  (ms)  vs the first")
    for name, v in r["variants"].items():
        line = f"{name:12}{ms(v['ttft_p50_s'])} {ms(v['ttft_p99_s'])} {ms(v['itl_p50_s'])} {ms(v['itl_p99_s'])}"
        vs = next((x for k, x in v.items() if k.startswith("vs_")), None)
        if vs is not None:
            line += f"  TTFT paired {ms(vs['ttft_paired_median_diff_s'])}  ITL p50 {ms(vs['itl_p50_diff_s'])}"
        print(line + (f"  ({len(v['errors'])} errors)" if v["errors"] else ""))
    for name, v in r["variants"].items():
        if v.get("hops"):
            print(f"{name} hops p50 (ms): " + ", ".join(f"{h} {x['p50_s'] * 1000:.2f}" for h, x in v["hops"].items()))
            path = v["first_token_path"]
            wakes = {k: x for k, x in path.items() if isinstance(x, dict) and k.endswith(("wake_s", "ack_s"))}
            print(f"{name} path p50 (ms): " + ", ".join(f"{k[:-2]} {x['p50_s'] * 1000:.2f}" for k, x in wakes.items()))
