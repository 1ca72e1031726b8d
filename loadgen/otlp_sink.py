"""A minimal OTLP/HTTP trace receiver: what `tandem bench gateway` and the trace tests collect
spans with, so the per-hop breakdown comes from the very spans a real collector would get.

It accepts `POST /v1/traces` with an `ExportTraceServiceRequest` (protobuf, gzip or not) and
keeps every span's trace id, name, service, hop attribute and times. Not a collector: no
storage, no other signals, loopback only.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str  # 32 hex digits
    name: str
    service: str
    hop: str | None  # the `tandem.hop` attribute (shared/tracing.py)
    start_ns: int
    end_ns: int

    @property
    def seconds(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e9


class OtlpSink:
    """`with OtlpSink() as sink:` ... `sink.url` is the endpoint to export to; `sink.spans()`."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                sink._add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:  # quiet
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpSink:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _add(self, req: ExportTraceServiceRequest) -> None:
        got = []
        for rs in req.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    hop = next((a.value.string_value for a in s.attributes if a.key == "tandem.hop"), None)
                    got.append(
                        ReceivedSpan(
                            s.trace_id.hex(), s.name, service, hop, s.start_time_unix_nano, s.end_time_unix_nano
                        )
                    )
        with self._lock:
            self._spans.extend(got)

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]
