"""The pure parts of `tandem bench gateway`'s per-hop breakdown and `tandem bench idle`."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from loadgen.bench.hop_path import (
    HOP_ORDER,
    KAFKA_HOPS,
    KAFKA_HOPS_GRANTED,
    SERVICE_HOPS,
    SERVICE_HOPS_GRANTED,
    first_token_path,
    hop_breakdown,
)
from loadgen.bench.idle import process_label
from loadgen.otlp_sink import ReceivedSpan


def _span(trace: str, hop: str | None, ms: float, name: str = "x") -> ReceivedSpan:
    return ReceivedSpan(trace, name, "tandem-gateway", hop, 1_000_000_000, 1_000_000_000 + int(ms * 1e6))


def test_hop_breakdown_keeps_only_the_measured_traces_in_path_order():
    spans = [
        _span("a", "worker.consume", 2.0),
        _span("b", "worker.consume", 4.0),
        _span("a", "gateway.accept", 1.0),
        _span("warmup", "gateway.accept", 500.0),  # not a measured request
        _span("a", None, 9.0, name="gateway.request"),  # the root span is not a hop
    ]
    got = hop_breakdown(spans, {"a", "b"})
    assert list(got) == ["gateway.accept", "worker.consume"]  # HOP_ORDER, not arrival order
    assert got["gateway.accept"] == {"p50_s": 0.001, "p99_s": 0.001, "count": 1}
    assert got["worker.consume"]["count"] == 2 and 0.002 <= got["worker.consume"]["p50_s"] <= 0.004
    assert HOP_ORDER[0] == "gateway.accept" and HOP_ORDER[-1] == "gateway.sse_write"


def test_first_token_path_adds_up_per_request_and_splits_each_kafka_hop():
    # Request "a": every hop 1 ms except the consumes (3 ms, holding a 1 ms produce each): Kafka
    # 9 ms, services 5 ms, TTFT 20 ms -> 6 ms untraced. "b" lacks a hop: left out, not guessed.
    spans = [_span("a", h, 1.0) for h in SERVICE_HOPS]
    spans += [s for c, p in KAFKA_HOPS for s in (_span("a", c, 3.0), _span("a", p, 1.0))]
    spans += [_span("b", "gateway.accept", 1.0)]
    got = first_token_path(spans, {"a": 0.020, "b": 0.030})
    assert got["requests"] == 1 and got["kafka_hops"] == 3
    expected = {"kafka_s": 0.009, "services_s": 0.005, "untraced_s": 0.006, "ttft_s": 0.020}
    for consume, _produce in KAFKA_HOPS:
        expected |= {f"{consume}.ack_s": 0.001, f"{consume}.wake_s": 0.002}
    assert {k: round(got[k]["p50_s"], 9) for k in expected} == expected


def test_first_token_path_of_granted_requests_has_two_kafka_hops():
    # "a" and "c" were sent by grant (no scheduler spans), "b" through the scheduler: the parts
    # are the granted path's (most requests took it), with both paths counted.
    spans = []
    for trace in ("a", "c"):
        spans += [_span(trace, h, 1.0) for h in SERVICE_HOPS_GRANTED]
        spans += [s for c, p in KAFKA_HOPS_GRANTED for s in (_span(trace, c, 3.0), _span(trace, p, 1.0))]
    spans += [_span("b", h, 1.0) for h in SERVICE_HOPS]
    spans += [s for c, p in KAFKA_HOPS for s in (_span("b", c, 3.0), _span("b", p, 1.0))]
    got = first_token_path(spans, {"a": 0.020, "b": 0.030, "c": 0.020})
    assert got["paths"] == {"three_hop": 1, "two_hop": 2}
    assert got["requests"] == 2 and got["kafka_hops"] == 2
    expected = {"kafka_s": 0.006, "services_s": 0.004, "untraced_s": 0.010, "ttft_s": 0.020}
    expected |= {"worker.consume.ack_s": 0.001, "gateway.consume.wake_s": 0.002}
    assert {k: round(got[k]["p50_s"], 9) for k in expected} == expected
    assert "scheduler.consume.ack_s" not in got


def test_idle_bench_names_processes_by_their_role():
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; time.sleep(60)", "services.cli", "worker", "--worker-id", "w7"]
    )
    try:
        proc = psutil.Process(child.pid)
        deadline = time.monotonic() + 30
        while "services.cli" not in proc.cmdline():  # until the child has exec'd (empty before)
            assert time.monotonic() < deadline, "child never started"
            time.sleep(0.01)
        # argv as `tandem up` starts a worker: `python -m services.cli worker ... --worker-id ID`
        assert process_label(proc) == "w7"
    finally:
        child.kill()
        child.wait()


def test_gateway_ab_parses_variants_and_pairs_rounds():
    from loadgen.bench.gateway_ab import parse_variant, summarise

    a = parse_variant("grants:TANDEM_RT_GRANTS=true,TANDEM_KAFKA_FETCH_WAIT_MS=1")
    b = parse_variant("main@/tmp/x")
    assert (a.name, a.checkout) == ("grants", None)
    assert a.env == {"TANDEM_RT_GRANTS": "true", "TANDEM_KAFKA_FETCH_WAIT_MS": "1"}
    assert (b.name, b.env, b.checkout) == ("main", {}, "/tmp/x")
    a.ttfts, a.itls, a.rounds = [0.010, 0.020, 0.030], [0.001, 0.002], [3, 4, 5]
    b.ttfts, b.itls, b.rounds = [0.012, 0.026, 0.031], [0.002, 0.004], [3, 4, 5]
    got = summarise([a, b], type("Args", (), {"model": "tiny", "rounds": 3, "max_tokens": 4}))
    vs = got["variants"]["main"]["vs_grants"]
    assert round(vs["ttft_paired_median_diff_s"], 9) == 0.002  # per round: +2, +6, +1 ms
    b.ttfts, b.rounds = [0.026, 0.031], [4, 5]  # round 3 failed on main: the rest stay paired
    row = summarise([a, b], type("Args", (), {"model": "tiny", "rounds": 3, "max_tokens": 4}))["variants"]["main"]
    assert round(row["vs_grants"]["ttft_paired_median_diff_s"], 9) == 0.0035  # +6, +1 ms
    assert row["ttft_rounds"] == [4, 5]
    assert round(vs["itl_p50_diff_s"], 9) == 0.0015
    assert "vs_grants" not in got["variants"]["grants"]
