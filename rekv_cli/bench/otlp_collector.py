"""An OTLP trace collector for the tracing test and benchmark: a gRPC server on loopback
implementing OpenTelemetry's `TraceService` (the proto a deployment's collector serves), keeping
every span it is sent (`keep=False`: counting them only).

`OtlpCollector()` listens on a free port (`endpoint`, for `OTEL_EXPORTER_OTLP_ENDPOINT`);
`spans` are the `CollectedSpan`s received so far, with the `service.name` of their resource;
`received` counts them; `stop()` closes it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status


def _value(value: AnyValue):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass(frozen=True)
class CollectedSpan:
    service: str
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    kind: str  # SERVER, CLIENT, INTERNAL
    start_ns: int
    end_ns: int
    attributes: dict
    events: list[tuple[str, int]]  # (name, ns)
    failed: bool


def _collected(service: str, span: Span) -> CollectedSpan:
    return CollectedSpan(
        service, span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
        Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"), span.start_time_unix_nano,
        span.end_time_unix_nano, {a.key: _value(a.value) for a in span.attributes},
        [(e.name, e.time_unix_nano) for e in span.events],
        span.status.code == Status.STATUS_CODE_ERROR)


class OtlpCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, keep: bool = True):
        self.keep, self.received = keep, 0
        self._spans: list[CollectedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        received, count = [], 0
        for resource_spans in request.resource_spans:
            service = next((_value(a.value) for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope in resource_spans.scope_spans:
                count += len(scope.spans)
                if self.keep:
                    received += [_collected(service, span) for span in scope.spans]
        with self._lock:
            self._spans += received
            self.received += count
        return trace_service_pb2.ExportTraceServiceResponse()

    @property
    def spans(self) -> list[CollectedSpan]:
        with self._lock:
            return list(self._spans)

    def stop(self) -> None:
        self._server.stop(0)
