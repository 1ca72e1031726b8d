"""One request's trace across gateway, scheduler and worker: W3C context over HTTP and Kafka
headers, every hop a span exported over OTLP, and per-hop histograms on /metrics."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadgen.otlp_sink import OtlpSink
from tests.services.conftest import chat_body

pytestmark = pytest.mark.timeout(600)  # stacks or services start inside tests: their start counts

HOPS = {
    "gateway": {"gateway.accept", "gateway.produce", "gateway.consume", "gateway.sse_write"},
    "scheduler": {"scheduler.consume", "scheduler.place", "scheduler.produce"},
    "worker": {
        "worker.consume",
        "worker.engine_queue",
        "worker.first_token",
        "worker.result_produce",
        # the hand-off's stages (services/worker/requests.py), recorded once the last token left
        *("worker.to_engine", "worker.engine_add", "worker.step_wait", "worker.first_step", "worker.to_loop"),
    },
}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def _hop_counts(metrics_text: str) -> dict[str, float]:
    return {
        s.labels["hop"]: s.value
        for family in text_string_to_metric_families(metrics_text)
        if family.name == "tandem_hop_seconds"
        for s in family.samples
        if s.name == "tandem_hop_seconds_count"
    }


def test_a_request_is_traced_across_every_hop(make_stack):
    with OtlpSink() as sink:
        # A short export delay so the test's wait ends soon after the spans exist.
        # The three-hop path's hops (a request sent by grant has no scheduler hops: test_rt_grants.py)
        stack = make_stack(
            TANDEM_OTLP_ENDPOINT=sink.url, OTEL_BSP_SCHEDULE_DELAY="100", TANDEM_RT_GRANTS="false"
        ).start()
        headers = {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}
        with httpx.stream(
            "POST", f"{stack.url}/v1/chat/completions", json=chat_body("hi", stream=True), headers=headers, timeout=120
        ) as r:
            assert r.status_code == 200
            assert r.headers["traceparent"].split("-")[1] == TRACE_ID  # the client's trace continues
            assert any(line == "data: [DONE]" for line in r.iter_lines())

        # Every hop, and the root span (ended when the stream closed), reach the receiver.
        want = {*set().union(*HOPS.values()), "gateway.request"}
        stack.wait_until("every hop's span exported", lambda: want <= {s.hop or s.name for s in sink.spans(TRACE_ID)})
        spans = sink.spans(TRACE_ID)
        for service, hops in HOPS.items():
            assert hops <= {s.hop for s in spans if s.service == f"tandem-{service}"}, service

        # The same hops, summarised on /metrics whether or not anything is exported.
        gateway = _hop_counts(httpx.get(f"{stack.url}/metrics", timeout=60).text)
        scheduler = _hop_counts(httpx.get(f"{stack.scheduler_url}/metrics", timeout=60).text)
        assert all(gateway.get(h, 0) >= 1 for h in HOPS["gateway"]), gateway
        assert all(scheduler.get(h, 0) >= 1 for h in HOPS["scheduler"]), scheduler
