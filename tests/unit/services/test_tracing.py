"""Request tracing in this process (`services.tracing`, `services.tracing_sdk`): when the `OTEL_*`
variables turn it on, what a bad value says, a machine without OpenTelemetry, and the spans a
trace records (parents, times, events, the context handed to a call), read back from the SDK's
in-memory exporter."""

import logging
import sys
import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from services.request_spans import MessageLog
from services.tracing import NO_SPAN, OFF, TRACING_OFF, Tracing, wanted
from services.tracing_sdk import SdkTracing

ROUTER_TRACE, ROUTER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{ROUTER_TRACE}-{ROUTER_SPAN}-01"


@pytest.mark.parametrize("environ", [
    {}, {"OTEL_SERVICE_NAME": "x"}, {"OTEL_TRACES_EXPORTER": "none"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"},
    {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "TRUE"},
], ids=["nothing", "only-a-name", "exporter-none", "disabled", "disabled-upper"])
def test_tracing_is_off_unless_an_exporter_or_endpoint_is_asked_for(environ):
    assert not wanted(environ)
    tracing = Tracing.from_env("decode", environ)
    assert tracing is TRACING_OFF and not tracing.recording
    assert tracing.request("Generate", [("traceparent", TRACEPARENT)]) is OFF


@pytest.mark.parametrize("environ", [
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"},
    {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}, {"OTEL_TRACES_EXPORTER": "console"},
])
def test_an_endpoint_or_an_exporter_turns_it_on(environ, monkeypatch):
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    tracing = Tracing.from_env("prefill", environ)
    try:
        assert isinstance(tracing, SdkTracing) and tracing.recording
        assert tracing.resource.attributes["service.name"] == "rekv-prefill"
    finally:
        tracing.shutdown()


def test_otel_service_name_wins_over_the_default(monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "decode-eu-1")
    tracing = Tracing.from_env("decode", {"OTEL_TRACES_EXPORTER": "console"})
    try:
        assert tracing.resource.attributes["service.name"] == "decode-eu-1"
        assert tracing.resource.attributes["rekv.role"] == "decode"
    finally:
        tracing.shutdown()


@pytest.mark.parametrize("environ, field", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL":
      "http/protobuf"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
])
def test_a_setting_it_cannot_serve_names_the_variable(environ, field):
    with pytest.raises(ValueError, match=field):
        Tracing.from_env("decode", environ)


def test_without_opentelemetry_installed_tracing_is_off_and_says_so(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "services.tracing_sdk", None)  # import fails
    with caplog.at_level(logging.WARNING, "rekv.tracing"):
        tracing = Tracing.from_env("decode", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"})
    assert tracing is TRACING_OFF
    assert "OpenTelemetry is not installed" in caplog.text and "tracing is off" in caplog.text


def test_the_off_trace_keeps_nothing_and_hands_no_context():
    with OFF.span("admission", queue=3) as span:
        span.set(x=1)
        span.event("e")
    assert span is NO_SPAN and span.metadata() == () and not span.recording
    assert OFF.record("join", 1.0, 2.0, events=[("a", 1.5)]) is NO_SPAN
    OFF.end(RuntimeError("x"))


@pytest.fixture
def recorded():
    exporter = InMemorySpanExporter()
    tracing = SdkTracing("decode", exporter)
    yield tracing, exporter
    tracing.shutdown()


def _finished(tracing, exporter):
    tracing.provider.force_flush()
    return {s.name: s for s in exporter.get_finished_spans()}


def test_a_request_continues_the_routers_trace_and_parents_every_span(recorded):
    tracing, exporter = recorded
    trace = tracing.request("Generate", [("traceparent", TRACEPARENT), ("x-other", "1")],
                            request_id="r1")
    with trace.span("handoff") as handoff:
        negotiation = trace.span("negotiation", handoff, client=True, peer="p:1")
        metadata = dict(negotiation.metadata())
        negotiation.end()
    trace.end()
    spans = _finished(tracing, exporter)
    root = spans["rekv.v1.Decode/Generate"]
    assert root.kind == SpanKind.SERVER and f"{root.context.trace_id:032x}" == ROUTER_TRACE
    assert f"{root.parent.span_id:016x}" == ROUTER_SPAN
    assert root.attributes["rekv.request_id"] == "r1"
    assert root.attributes["rpc.method"] == "Generate"
    assert spans["handoff"].parent.span_id == root.context.span_id
    child = spans["negotiation"]
    assert child.parent.span_id == spans["handoff"].context.span_id
    assert child.kind == SpanKind.CLIENT and child.attributes["rekv.peer"] == "p:1"
    # the context handed to the call names the negotiation span, in the same trace
    assert metadata["traceparent"] == (f"00-{ROUTER_TRACE}-{child.context.span_id:016x}-01")


def test_a_call_without_or_with_a_broken_trace_context_starts_a_trace(recorded):
    tracing, exporter = recorded
    for metadata in (None, [("traceparent", "00-zz-broken-01")]):
        tracing.request("Handoff", metadata).end()
    tracing.provider.force_flush()
    roots = [s for s in exporter.get_finished_spans() if s.name == "rekv.v1.Prefill/Handoff"]
    assert len(roots) == 2 and all(s.parent is None for s in roots)
    assert roots[0].context.trace_id != roots[1].context.trace_id


def test_a_span_after_the_fact_keeps_its_times_and_events(recorded):
    tracing, exporter = recorded
    trace = tracing.request("Handoff")
    now = time.perf_counter()
    trace.record("prefix_layers", now - 0.050, now - 0.010, events=[("layer.0", now - 0.040)],
                 layers=1, skipped=None)
    trace.end()
    spans = _finished(tracing, exporter)
    span = spans["prefix_layers"]
    assert (span.end_time - span.start_time) / 1e6 == pytest.approx(40.0, abs=0.01)
    assert (span.events[0].timestamp - span.start_time) / 1e6 == pytest.approx(10.0, abs=0.01)
    assert span.attributes == {"rekv.layers": 1}  # None is left out
    assert abs(span.end_time - (time.time_ns() - 10_000_000)) < 1e9  # the wall clock's now


def test_ending_a_trace_ends_its_open_spans_once_and_marks_failures(recorded):
    tracing, exporter = recorded
    trace = tracing.request("Generate")
    left_open = trace.span("decode")
    closed = trace.span("first_token")
    closed.end()
    closed.end(RuntimeError("late"))  # the first end counts
    with pytest.raises(KeyError):
        with trace.span("plan"):
            raise KeyError("codec")
    trace.end(ConnectionError("peer gone"))
    spans = _finished(tracing, exporter)
    assert set(spans) == {"rekv.v1.Decode/Generate", "decode", "first_token", "plan"}
    assert left_open.ended and spans["decode"].status.status_code == StatusCode.ERROR
    assert spans["first_token"].status.status_code == StatusCode.UNSET
    assert "KeyError" in spans["plan"].status.description
    assert "peer gone" in spans["rekv.v1.Decode/Generate"].status.description


class _Faults:
    def __init__(self):
        self.seen = []

    def before_send(self, message):
        return ("changed", message)

    def after_send(self, name):
        self.seen.append(name)


def test_the_message_log_notes_each_message_around_the_fault_hooks(recorded):
    tracing, exporter = recorded
    faults = _Faults()
    log = MessageLog().wrapping(faults)
    assert log.before_send("m") == ("changed", "m")
    for name in ("plan", "layer.0", "layer.1", "boundary", "boundary.1"):
        log.after_send(name)
    assert faults.seen == ["plan", "layer.0", "layer.1", "boundary", "boundary.1"]
    trace = tracing.request("Handoff")
    log.record(trace, trace.root)
    trace.end()
    spans = _finished(tracing, exporter)
    assert [e.name for e in spans["prefix_layers"].events] == ["layer.0", "layer.1"]
    assert [e.name for e in spans["boundary"].events] == ["boundary", "boundary.1"]
    assert spans["boundary"].attributes["rekv.messages"] == 2
    assert MessageLog().before_send("m") == "m"


def test_a_callers_long_strings_are_cut_unless_the_limit_variables_say_otherwise():
    for environ, kept in (({}, 256), ({"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "1000"}, 1000)):
        exporter = InMemorySpanExporter()
        with pytest.MonkeyPatch.context() as patch:  # the SDK reads the limit it is left
            for name, value in environ.items():
                patch.setenv(name, value)
            tracing = SdkTracing("decode", exporter, environ)
            tracing.request("Generate", request_id="x" * 5000).end()
        tracing.shutdown()
        (span,) = exporter.get_finished_spans()
        assert len(span.attributes["rekv.request_id"]) == kept
