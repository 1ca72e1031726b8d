"""Traces across every hop of a request: W3C trace context, OpenTelemetry spans, hop histograms.

A request's trace starts at the gateway (continuing the client's `traceparent` header when it
sends one) and travels with the request on Kafka as record headers: `traceparent` (W3C) and
`tandem-sent-ns` (the sender's wall clock when it handed the record to the producer), so each
consumer can time the Kafka hop that brought the record. Results are batched across requests
(one message per engine step per gateway), so they carry only `tandem-sent-ns`; the gateway
parents its result-side spans to the request span it already holds.

Every service owns one `Tracing` (explicit, no global provider). Spans always feed the
`tandem_hop_seconds{hop}` histogram on the service's `/metrics`; they are exported over OTLP/HTTP
only when `TANDEM_OTLP_ENDPOINT` is set (e.g. `http://collector:4318/v1/traces`). Hop names:

| hop | service | from → to |
|---|---|---|
| `gateway.accept` | gateway | HTTP request read → request handed to the producer |
| `gateway.produce` | gateway | → the broker acked the request |
| `scheduler.consume` | scheduler | gateway's send → scheduler read the record (the Kafka hop) |
| `scheduler.place` | scheduler | read → dispatch handed to the producer |
| `scheduler.produce` | scheduler | → the broker acked the dispatch |
| `worker.consume` | worker | scheduler's send → worker read the dispatch (the Kafka hop) |
| `worker.engine_queue` | worker | read → the worker's loop has the engine's acceptance (tokenized, validated, queued) |
| `worker.first_token` | worker | acceptance → the first token's delta on the worker's loop |
| `worker.to_engine` | worker | read → the engine thread took the request (its stamp; split of the two above) |
| `worker.engine_add` | worker | taken → the engine queued it (tokenize, validate) |
| `worker.step_wait` | worker | queued → its first step started (a step in progress) |
| `worker.first_step` | worker | that step, start → end |
| `worker.to_loop` | worker | step end → its delta on the worker's event loop (the thread hop back) |
| `worker.result_produce` | worker | first token → the broker acked the batch that carries it |
| `gateway.consume` | gateway | worker's send → gateway read the batch (the Kafka hop) |
| `gateway.sse_write` | gateway | batch read → first token's SSE chunk handed to the server |

Spans are recorded once what they time has left the service (the request, the dispatch, the
first token's batch), never on its path: each costs the event loop ~50-120 us (issue 21, ninth
session). Cross-process hops subtract two wall clocks: exact on one machine, as good as the hosts' clock
sync across machines (a negative duration is clamped to 0 rather than dropped).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import Span, SpanKind, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.metrics import ServiceMetrics

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
SENT_NS = "tandem-sent-ns"
HOP_ATTR = "tandem.hop"
_PROPAGATOR = TraceContextTextMapPropagator()

KafkaHeaders = list[tuple[str, bytes]]


class _HopHistogram(SpanProcessor):
    """Every finished hop span into `tandem_hop_seconds{hop}` (always on, OTLP or not)."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._hist = metrics.histogram("hop_seconds", "latency of one hop of a request's path", ("hop",))

    def on_end(self, span: ReadableSpan) -> None:
        hop = span.attributes.get(HOP_ATTR) if span.attributes else None
        if hop is not None and span.end_time is not None and span.start_time is not None:
            self._hist.labels(hop=hop).observe(max(0, span.end_time - span.start_time) / 1e9)


class Tracing:
    """One service's tracer: spans for its hops, trace context in and out of Kafka and HTTP."""

    def __init__(self, service: str, metrics: ServiceMetrics, otlp_endpoint: str = "") -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": f"tandem-{service}"}))
        self.provider.add_span_processor(_HopHistogram(metrics))
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
            log.info("exporting traces over OTLP to %s", otlp_endpoint)
        self.tracer = self.provider.get_tracer("tandem")

    # Spans -----------------------------------------------------------------------------------
    def start_request(self, incoming: Mapping[str, str] | None = None) -> Span:
        """The root span of one request at the gateway, a child of the client's `traceparent`."""
        parent = _PROPAGATOR.extract(dict(incoming)) if incoming else None
        return self.tracer.start_span("gateway.request", context=parent, kind=SpanKind.SERVER)

    def hop(self, name: str, parent: Context | Span | None, start_ns: int, end_ns: int | None = None) -> None:
        """Record a finished hop from `start_ns` to `end_ns` (now if None), wall-clock ns."""
        end_ns = time.time_ns() if end_ns is None else end_ns
        ctx = set_span_in_context(parent) if isinstance(parent, Span) else parent
        span = self.tracer.start_span(name, context=ctx, start_time=min(start_ns, end_ns), attributes={HOP_ATTR: name})
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Flush what the OTLP exporter holds (called from the service's `stop`)."""
        self.provider.shutdown()

    # Propagation -----------------------------------------------------------------------------
    @staticmethod
    def kafka_headers(parent: Context | Span | None) -> KafkaHeaders:
        """`traceparent` of `parent` (if any) plus this moment, for a record about to be sent."""
        carrier: dict[str, str] = {}
        if parent is not None:
            ctx = set_span_in_context(parent) if isinstance(parent, Span) else parent
            _PROPAGATOR.inject(carrier, context=ctx)
        headers = [(k, v.encode()) for k, v in carrier.items()]
        headers.append((SENT_NS, str(time.time_ns()).encode()))
        return headers

    @staticmethod
    def http_headers(span: Span) -> dict[str, str]:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=set_span_in_context(span))
        return carrier


def context_of(headers: Sequence[tuple[str, bytes]] | None) -> Context | None:
    """The trace context a record carries (None if it carries none)."""
    for k, v in headers or ():
        if k == TRACEPARENT:
            return _PROPAGATOR.extract({TRACEPARENT: v.decode(errors="replace")})
    return None


def sent_ns(headers: Sequence[tuple[str, bytes]] | None) -> int | None:
    """When the record's sender handed it to its producer (wall-clock ns), if it says."""
    for k, v in headers or ():
        if k == SENT_NS:
            try:
                return int(v)
            except ValueError:
                return None
    return None
