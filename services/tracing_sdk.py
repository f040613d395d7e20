"""Tracing on: `services.tracing`'s interface over the OpenTelemetry SDK.

It implements the interface of `services.tracing`'s `Tracing`, `Trace` and `Span` (which this
module does not import: the off path must not need it). Imported only when the `OTEL_*`
variables ask for traces (`services.tracing.Tracing.from_env`), so a machine without
OpenTelemetry runs the services with tracing off. The SDK reads its own
variables: the resource (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`), the sampler
(`OTEL_TRACES_SAMPLER`), the batch processor (`OTEL_BSP_*`) and the OTLP exporter
(`OTEL_EXPORTER_OTLP_*`: endpoint, headers, TLS, timeout, compression).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter,
                                            SpanExporter)
from opentelemetry.trace import SpanKind, Status, StatusCode

RPC_SERVICES = {"Generate": "rekv.v1.Decode", "Handoff": "rekv.v1.Prefill"}
# A caller's strings (a request id) become attributes before they are checked: unless the
# OTEL_*ATTRIBUTE_VALUE_LENGTH_LIMIT variables say otherwise, no value is kept longer than this.
ATTRIBUTE_LENGTH = 256
LENGTH_LIMITS = ("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT")


def now_ns(at: float, offset_ns: int) -> int:
    """A `time.perf_counter()` reading as nanoseconds since the epoch, given the offset between
    the two clocks (`clock_offset_ns()`, read once per request)."""
    return int(at * 1e9) + offset_ns


def clock_offset_ns() -> int:
    return time.time_ns() - time.perf_counter_ns()


def _attributes(attributes: dict) -> dict:
    """`rekv.`-prefixed, and without the unset (None) ones."""
    return {f"rekv.{key}": value for key, value in attributes.items() if value is not None}


class SdkSpan:
    recording = True

    def __init__(self, span: trace.Span, offset_ns: int):
        self.span, self.offset_ns = span, offset_ns
        self.ended = False

    def set(self, **attributes) -> None:
        self.span.set_attributes(_attributes(attributes))

    def event(self, name: str, at: float | None = None, **attributes) -> None:
        self.span.add_event(name, _attributes(attributes),
                            None if at is None else now_ns(at, self.offset_ns))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(self.span))
        return tuple(carrier.items())

    def end(self, error: BaseException | None = None, at_ns: int | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self.span.end(at_ns)

    def __enter__(self) -> SdkSpan:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        self.end(exc)
        return False


class SdkTrace:
    recording = True

    def __init__(self, tracer: trace.Tracer, root: SdkSpan):
        self.tracer, self.root, self.offset_ns = tracer, root, root.offset_ns
        self.open: list[SdkSpan] = []

    def _start(self, name: str, parent: SdkSpan | None, start_ns: int | None,
               attributes: dict, kind: SpanKind = SpanKind.INTERNAL) -> trace.Span:
        parent_span = (parent if isinstance(parent, SdkSpan) else self.root).span
        return self.tracer.start_span(name, trace.set_span_in_context(parent_span), kind,
                                      _attributes(attributes), start_time=start_ns)

    def span(self, name: str, parent: SdkSpan | None = None, client: bool = False,
             **attributes) -> SdkSpan:
        kind = SpanKind.CLIENT if client else SpanKind.INTERNAL
        span = SdkSpan(self._start(name, parent, None, attributes, kind), self.offset_ns)
        self.open.append(span)
        return span

    def record(self, name: str, start: float, end: float, parent: SdkSpan | None = None,
               events: Iterable[tuple[str, float]] = (), **attributes) -> SdkSpan:
        span = self._start(name, parent, now_ns(start, self.offset_ns), attributes)
        for event, at in events:
            span.add_event(event, timestamp=now_ns(at, self.offset_ns))
        recorded = SdkSpan(span, self.offset_ns)
        recorded.end(at_ns=now_ns(max(start, end), self.offset_ns))
        return recorded

    def end(self, error: BaseException | None = None) -> None:
        for span in self.open:
            span.end(error)
        self.root.end(error)


class SdkTracing:
    recording = True

    def __init__(self, role: str, exporter: SpanExporter,
                 environ: Mapping[str, str] = os.environ):
        resource = Resource.create()
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: f"rekv-{role}"}))
        self.resource = resource.merge(Resource({"rekv.role": role}))
        limited = any(environ.get(name) for name in LENGTH_LIMITS)
        self.provider = TracerProvider(resource=self.resource, span_limits=SpanLimits(
            max_attribute_length=None if limited else ATTRIBUTE_LENGTH))
        self.exporter = exporter
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("rekv")

    def describe(self) -> str:
        endpoint = getattr(self.exporter, "_endpoint", None)
        name = self.resource.attributes.get(SERVICE_NAME)
        return f"service.name {name}" + (f", endpoint {endpoint}" if endpoint else "")

    def request(self, name: str, metadata: Iterable[tuple[str, str | bytes]] | None = None,
                **attributes) -> SdkTrace:
        carrier = {key: value for key, value in metadata or ()
                   if key in ("traceparent", "tracestate") and isinstance(value, str)}
        service = RPC_SERVICES.get(name, "")
        span = self.tracer.start_span(
            f"{service}/{name}", propagate.extract(carrier), kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name,
                        **_attributes(attributes)})
        return SdkTrace(self.tracer, SdkSpan(span, clock_offset_ns()))

    def shutdown(self) -> None:
        self.provider.shutdown()


def named_exporter(name: str) -> SpanExporter:
    """`OTEL_TRACES_EXPORTER`'s exporter: `console`, or `otlp` over gRPC (configured by the
    `OTEL_EXPORTER_OTLP_*` variables)."""
    if name == "console":
        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()
