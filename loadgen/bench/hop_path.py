"""Where a request's first-token time goes, from its trace spans (`tandem bench gateway`).

Two views of the spans of `shared/tracing.py`:

- `hop_breakdown`: p50/p99 of every hop over the measured traces, each hop on its own.
- `first_token_path`: per request, its client-measured TTFT split into the parts that add up to
  it, then p50/p99 of each part over the requests. The first token crosses three Kafka hops
  (gateway → scheduler, scheduler → worker, worker → gateway); each consume span is timed from
  the sender's send, so it holds that send's produce (its ack) and then the reader's wake-up (ack
  → the record read: a ring or the next fetch, and the fetch's answer). The produce spans
  therefore overlap the next consume and are not added again. A request sent by grant
  (`TANDEM_RT_GRANTS`, services/gateway/grants.py) crosses two (gateway → worker, worker →
  gateway) and has no scheduler spans: each request is split along the path its spans show, and
  the parts are those of the path most requests took (`paths` counts both). What the spans do not cover
  (`untraced`) is the client's HTTP request before the gateway reads it, the SSE chunk's trip
  back, and the gaps between spans (the worker's outbox hand-off, event-loop turns).
"""

from __future__ import annotations

from loadgen.bench.common import percentile
from loadgen.otlp_sink import ReceivedSpan

# A request's path in order (shared/tracing.py): the hops up to the first token.
HOP_ORDER = (
    "gateway.accept",
    "gateway.produce",
    "scheduler.consume",
    "scheduler.place",
    "scheduler.produce",
    "worker.consume",
    "worker.engine_queue",
    "worker.first_token",
    "worker.result_produce",
    "gateway.consume",
    "gateway.sse_write",
)

# The worker's hand-off into its engine, in order: `worker.engine_queue` + `worker.first_token`
# split at the engine thread's stamps (services/worker/requests.py); listed after the path.
HAND_OFF_HOPS = ("worker.to_engine", "worker.engine_add", "worker.step_wait", "worker.first_step", "worker.to_loop")

# Each Kafka hop of the first token's path: its consume span and the produce span inside it.
KAFKA_HOPS = (
    ("scheduler.consume", "gateway.produce"),
    ("worker.consume", "scheduler.produce"),
    ("gateway.consume", "worker.result_produce"),
)

# The work of the services between the Kafka hops (in process, no broker).
SERVICE_HOPS = ("gateway.accept", "scheduler.place", "worker.engine_queue", "worker.first_token", "gateway.sse_write")

# The same for a request the gateway sent straight to a worker within the scheduler's grant.
KAFKA_HOPS_GRANTED = (("worker.consume", "gateway.produce"), ("gateway.consume", "worker.result_produce"))
SERVICE_HOPS_GRANTED = tuple(h for h in SERVICE_HOPS if not h.startswith("scheduler."))
PATHS = {"three_hop": (KAFKA_HOPS, SERVICE_HOPS), "two_hop": (KAFKA_HOPS_GRANTED, SERVICE_HOPS_GRANTED)}


def hop_breakdown(spans: list[ReceivedSpan], trace_ids: set[str]) -> dict:
    """p50/p99 seconds of each hop over the given traces, and how many traces had that hop."""
    by_hop: dict[str, list[float]] = {}
    for s in spans:
        if s.hop is not None and s.trace_id in trace_ids:
            by_hop.setdefault(s.hop, []).append(s.seconds)
    known = HOP_ORDER + HAND_OFF_HOPS
    order = [h for h in known if h in by_hop] + sorted(set(by_hop) - set(known))
    return {
        h: {"p50_s": percentile(by_hop[h], 50), "p99_s": percentile(by_hop[h], 99), "count": len(by_hop[h])}
        for h in order
    }


def first_token_path(spans: list[ReceivedSpan], ttft_by_trace: dict[str, float]) -> dict:
    """Per request (trace) with every hop of its path: its TTFT as Kafka hops (each as produce ack
    and reader wake-up) + service work + untraced time; p50/p99 of each part over the requests
    of the path most took (`paths`: how many took each). Parts are added per request, so their
    p50s need not add up to the TTFT's p50."""
    hops: dict[str, dict[str, float]] = {}
    for s in spans:
        if s.hop is not None and s.trace_id in ttft_by_trace:
            hops.setdefault(s.trace_id, {})[s.hop] = s.seconds
    parts: dict[str, dict[str, list[float]]] = {name: {} for name in PATHS}
    for trace_id, got in hops.items():
        name = "three_hop" if "scheduler.consume" in got else "two_hop"
        kafka_hops, service_hops = PATHS[name]
        if not {h for pair in kafka_hops for h in pair} | set(service_hops) <= set(got):
            continue  # a hop's span was not exported (the stack stopped first): not comparable
        row = {}
        for consume, produce in kafka_hops:
            row[f"{consume}.ack_s"] = got[produce]
            row[f"{consume}.wake_s"] = max(0.0, got[consume] - got[produce])
        row["kafka_s"] = sum(got[c] for c, _ in kafka_hops)
        row["services_s"] = sum(got[h] for h in service_hops)
        row["ttft_s"] = ttft_by_trace[trace_id]
        row["untraced_s"] = row["ttft_s"] - row["kafka_s"] - row["services_s"]
        for k, v in row.items():
            parts[name].setdefault(k, []).append(v)
    counts = {name: len(p.get("ttft_s", [])) for name, p in parts.items()}
    name = max(PATHS, key=lambda n: (counts[n], n == "three_hop"))
    return {
        "requests": counts[name],
        "kafka_hops": len(PATHS[name][0]),
        "paths": counts,
        **{k: {"p50_s": percentile(v, 50), "p99_s": percentile(v, 99)} for k, v in parts[name].items()},
    }
