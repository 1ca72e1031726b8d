"""The pure parts of `tandem bench gateway`'s per-hop breakdown and `tandem bench idle`."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from loadgen.bench.gateway import HOP_ORDER, hop_breakdown
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
