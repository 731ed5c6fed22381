"""An OTLP/HTTP trace receiver for tests (docs/DESIGN.md, "Tracing"): what a collector receives
from a process exporting with ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``[telemetry] otlp_endpoint``,
decoded from the real protobuf the exporter sends.

    with running_collector() as collector:
        ...  # a process exports to collector.url
        collector.spans()  # [(path, service.name, span name), ...]
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class Collector(ThreadingHTTPServer):
    """Keeps each decoded export request, with the path it was posted to."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, ExportTraceServiceRequest]] = []
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def spans(self) -> list[tuple[str, str, str]]:
        """(path, service.name, span name) of every span received, in arrival order."""
        out = []
        for path, request in list(self.requests):
            for rs in request.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                service = resource["service.name"]
                for ss in rs.scope_spans:
                    out += [(path, service, span.name) for span in ss.spans]
        return out


class _Handler(BaseHTTPRequestHandler):
    server: Collector

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.server.requests.append((self.path, request))
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def running_collector() -> Iterator[Collector]:
    server = Collector()
    thread = threading.Thread(target=server.serve_forever, name="otlp-collector", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
