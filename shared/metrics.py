"""Prometheus helpers: each service owns one `CollectorRegistry` (no process-global metrics), and
services without an HTTP API of their own expose it on `metrics_port`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Latency buckets from 1 ms to 60 s: TTFT of a cached chat turn up to a long batch prompt.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServiceMetrics:
    """A registry plus constructors that register into it."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry()

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(f"tandem_{name}", doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(f"tandem_{name}", doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
        return Histogram(f"tandem_{name}", doc, labels, registry=self.registry, buckets=LATENCY_BUCKETS)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def serve(self, port: int) -> None:
        if port:
            start_http_server(port, addr="0.0.0.0", registry=self.registry)
