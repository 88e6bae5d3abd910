"""A real OTLP trace receiver on loopback, for tests: the collector's gRPC TraceService/Export
(what OTLP/gRPC exporters send to port 4317) and, beside it, OTLP/HTTP ``POST /v1/traces``
(protobuf, port 4318's protocol). Spans are kept as plain ``ReceivedSpan`` records."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


def _value(v: common_pb2.AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    events: tuple[tuple[str, int, dict], ...]  # (name, time_ns, attributes)
    status_code: int  # 0 unset, 1 ok, 2 error
    raw: bytes  # the span as exported, to search for strings that must not be there


class OTLPReceiver:
    """Start with ``start()``; ``grpc_endpoint`` / ``http_endpoint``; ``stop()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self),
                                                                  self._grpc)
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _http_handler(self))
        self.http_port = self._http.server_address[1]
        self._http_thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        """The base URL (OTEL_EXPORTER_OTLP_ENDPOINT); exporters add /v1/traces."""
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> OTLPReceiver:
        self._grpc.start()
        self._http_thread.start()
        return self

    def stop(self) -> None:
        self._grpc.stop(0)
        self._http.shutdown()
        self._http.server_close()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        service=service, name=span.name, trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(),
                        kind=span.kind, start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes),
                        events=tuple((e.name, e.time_unix_nano, _attributes(e.attributes))
                                     for e in span.events),
                        status_code=span.status.code, raw=span.SerializeToString()))
        with self._lock:
            self._spans.extend(spans)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def wait_for(self, predicate, timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """The spans once ``predicate(spans)`` holds (the last ones seen on timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OTLPReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):
        self.receiver.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def _http_handler(receiver: OTLPReceiver):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            receiver.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args) -> None:
            pass

    return Handler
