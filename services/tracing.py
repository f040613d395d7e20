"""Request tracing with OpenTelemetry: one trace per request, across both services.

`Tracing.from_env(role)` reads the standard `OTEL_*` variables once, at start:
- off, the default: none of `OTEL_TRACES_EXPORTER`, `OTEL_EXPORTER_OTLP_ENDPOINT`,
  `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` set, or `OTEL_SDK_DISABLED=true`, or
  `OTEL_TRACES_EXPORTER=none`. Nothing of OpenTelemetry is imported and every trace is `OFF`,
  whose methods do nothing;
- on: an SDK `TracerProvider` (resource from `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
  `service.name` `rekv-<role>` unless they name one; sampler from `OTEL_TRACES_SAMPLER` and its
  `_ARG`, parent-based always-on by default; attribute values cut at 256 characters unless the
  `OTEL_*ATTRIBUTE_VALUE_LENGTH_LIMIT` variables set a limit) and a batch processor
  (`OTEL_BSP_*`) feeding the exporter `OTEL_TRACES_EXPORTER` names: `otlp` (the default; gRPC,
  configured by the `OTEL_EXPORTER_OTLP_*` variables) or `console`;
- asked for on a machine without the packages: off, with a warning saying so.
A value it cannot serve (another exporter, an OTLP protocol other than `grpc`) is a ValueError
naming the variable, at start. `shutdown()` flushes what is still queued.

Per request, `request(name, metadata, **attributes)` opens the server span, a child of the W3C
trace context (`traceparent`, `tracestate`) in the call's gRPC metadata, as a `Trace`:
- `span(name, parent=None, client=False, **attributes)`: a child of `parent` (default: the
  server span; `client`: of kind CLIENT, for a call made under it), started now, a context
  manager giving its `Span`; an exception leaving it marks it failed;
- `record(name, start, end, parent=None, events=(), **attributes)`: a span after the fact, from
  `time.perf_counter()` readings (a worker thread's timings), with (name, time) events;
- `end(error=None)`, which also ends every span of the trace still open (a call cancelled
  mid-stream).
A `Span` takes `set(**attributes)`, `event(name, at=None, **attributes)`, `end(error=None)` (the
first end counts) and gives `metadata()`: its context as gRPC metadata for a call made under
it. Attribute names get the prefix `rekv.`.
Spans are parented explicitly, never through the current context, so an async generator that
yields between them, or a worker thread, cannot mix two requests' traces. `recording` says
whether anything is kept: callers skip building attributes when it is False.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

log = logging.getLogger("rekv.tracing")

ASKING = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
          "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
EXPORTERS = ("otlp", "console")


class Span:
    """A span that keeps nothing (tracing off)."""

    recording = False

    def set(self, **attributes) -> None:
        pass

    def event(self, name: str, at: float | None = None, **attributes) -> None:
        pass

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def end(self, error: BaseException | None = None) -> None:
        pass

    def __enter__(self) -> Span:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        return False


NO_SPAN = Span()


class Trace:
    """One request's spans; this one keeps nothing (tracing off)."""

    recording = False
    root = NO_SPAN

    def span(self, name: str, parent: Span | None = None, client: bool = False,
             **attributes) -> Span:
        return NO_SPAN

    def record(self, name: str, start: float, end: float, parent: Span | None = None,
               events: Iterable[tuple[str, float]] = (), **attributes) -> Span:
        return NO_SPAN

    def end(self, error: BaseException | None = None) -> None:
        pass


OFF = Trace()


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the environment asks for traces (module doc)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return any(environ.get(name, "").strip() for name in ASKING)


class Tracing:
    """The service's tracer (module doc); this one is off."""

    recording = False

    def request(self, name: str, metadata: Iterable[tuple[str, str | bytes]] | None = None,
                **attributes) -> Trace:
        return OFF

    def shutdown(self) -> None:
        pass

    @staticmethod
    def from_env(role: str, environ: Mapping[str, str] = os.environ) -> Tracing:
        if not wanted(environ):
            return TRACING_OFF
        exporter = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
        if exporter not in EXPORTERS:
            raise ValueError(f"OTEL_TRACES_EXPORTER: rekv exports traces by {EXPORTERS}, got "
                             f"{exporter!r}")
        protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
        if exporter == "otlp" and protocol != "grpc":
            raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: rekv exports OTLP over grpc, got "
                             f"{protocol!r}")
        try:
            from services.tracing_sdk import SdkTracing, named_exporter
        except ImportError as exc:  # a machine without the packages (the lent GPU machine)
            log.warning("tracing: the OTEL_* variables ask for traces, but OpenTelemetry is not "
                        "installed (%s); tracing is off", exc)
            return TRACING_OFF
        tracing = SdkTracing(role, named_exporter(exporter))
        log.info("tracing: on, exporting by %s (%s)", exporter, tracing.describe())
        return tracing


TRACING_OFF = Tracing()
