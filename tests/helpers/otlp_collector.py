"""A local OTLP/HTTP collector: receives what real OpenTelemetry exporters send
(``POST /v1/traces`` and ``/v1/metrics``, protobuf, optionally gzip) and keeps the spans
and metric names for tests to read. It answers as a collector does (an empty export
response), so the exporters see success."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from tests.helpers.waits import wait_until


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    service: str
    attributes: dict[str, Any]
    kind: int


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    return getattr(v, which) if which else None


@dataclass
class Collector:
    spans: list[Span] = field(default_factory=list)
    metric_names: set[str] = field(default_factory=set)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def add_traces(self, body: bytes) -> None:
        req = trace_service_pb2.ExportTraceServiceRequest()
        req.ParseFromString(body)
        got = []
        for rs in req.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            service=str(res.get("service.name", "")),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            kind=int(s.kind),
                        )
                    )
        with self.lock:
            self.spans.extend(got)

    def add_metrics(self, body: bytes) -> None:
        req = metrics_service_pb2.ExportMetricsServiceRequest()
        req.ParseFromString(body)
        names = {
            m.name for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
        }
        with self.lock:
            self.metric_names |= names

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)

    def wait_for(self, predicate: Any, timeout: float = 20.0) -> list[Span]:
        """The spans received, once ``predicate(spans)`` holds."""

        def met() -> list[Span] | None:
            spans = self.snapshot()
            return spans if predicate(spans) else None

        got = wait_until(
            met,
            timeout=timeout,
            what="the spans the test waits for",
            interval=0.1,
            detail=lambda: f"spans: {sorted({s.name for s in self.snapshot()})}",
        )
        assert got is not None
        return got

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def start_collector() -> Collector:
    collector = Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            with collector.lock:
                collector.requests += 1
            if self.path == "/v1/traces":
                collector.add_traces(body)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            elif self.path == "/v1/metrics":
                collector.add_metrics(body)
                reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    collector.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=collector.server.serve_forever, daemon=True).start()
    return collector
