"""Request tracing across the two services as real processes: each exports OTLP over gRPC, as
configured by the standard `OTEL_*` variables, to a collector in this test
(`rekv_cli/bench/otlp_collector.py`). A router's W3C `traceparent` on `Decode.Generate` makes
one trace of both processes' spans, in the right parent-child structure, with the handoff's
attributes; without OpenTelemetry installed both serve, untraced, and say why."""

import secrets

import grpc
import pytest

from rekv_cli.bench.otlp_collector import OtlpCollector
from rekv_cli.client import generate
from rekv_cli.launcher import ServicePair
from tests.support.paths import ROOT

SETTINGS = ["--dtype", "bfloat16", "--torch-threads", "1", "--max-prompt-tokens", "256",
            "--max-new-tokens", "16", "--codecs", "bf16,int8",
            "--profile", str(ROOT / "rekv_core/plan/profiles/smollm2-135m.json")]
PROMPT = "The capital of France is Paris. The capital of Italy is"
CUT = 15
SLACK_NS = 5_000_000  # two processes' readings of one clock, each span's ends rounded


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """Three requests through both services, then the spans both exported by the time they
    stopped: a router's traced one, one without a trace context, one whose handoff fails."""
    collector = OtlpCollector()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
           "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    router = (secrets.token_hex(16), secrets.token_hex(8))
    pair = ServicePair([*SETTINGS, "--fault-inject", "by_request"], SETTINGS,
                       log_dir=tmp_path_factory.mktemp("tracing"), env=env)
    try:
        with grpc.insecure_channel(pair.decode_address) as channel:
            results = {
                "traced": generate(channel, "traced", PROMPT, 4, ("int8", CUT),
                                   forced_schedule=(True, 0, False),  # layer order
                                   metadata=[("traceparent", f"00-{router[0]}-{router[1]}-01")]),
                "untraced": generate(channel, "untraced", PROMPT, 2, ("bf16", CUT)),
                # token order: the bit flipped is the boundary's (the first payload), which
                # nothing salvages, so the prompt is recomputed here from its token ids
                "failed": generate(channel, "flip_bit/failed", PROMPT, 2, ("int8", CUT),
                                   forced_schedule=(True, 256, True)),
            }
    finally:
        codes = pair.stop()  # each flushes its spans on the way out
        collector.stop()
    assert codes == {"decode": 0, "prefill": 0}
    return collector.spans, router, results


def _one(spans, **match):
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, f"{match}: {len(found)} spans of {[s.name for s in spans]}"
    return found[0]


def _children(spans, parent):
    return {s.name: s for s in spans if s.parent_id == parent.span_id}


def _inside(child, parent):
    low, high = parent.start_ns - SLACK_NS, parent.end_ns + SLACK_NS
    assert low <= child.start_ns <= child.end_ns <= high, (
        f"{child.name} [{child.start_ns}, {child.end_ns}] outside {parent.name} "
        f"[{parent.start_ns}, {parent.end_ns}]")


def test_a_routers_request_is_one_trace_across_both_processes(traced):
    spans, (trace_id, router_span), results = traced
    assert not results["traced"].summary.fallback
    mine = [s for s in spans if s.trace_id == trace_id]
    assert {s.service for s in mine} == {"rekv-decode", "rekv-prefill"}
    generate_span = _one(mine, name="rekv.v1.Decode/Generate")
    assert (generate_span.kind, generate_span.parent_id) == ("SERVER", router_span)
    assert generate_span.attributes["rekv.request_id"] == "traced"
    top = _children(mine, generate_span)
    assert set(top) == {"admission", "handoff", "first_token", "decode"}
    handoff = top["handoff"]
    parts = _children(mine, handoff)
    assert set(parts) == {"negotiation", "boundary", "prefix_layers", "suffix", "join"}
    negotiation = parts["negotiation"]
    assert negotiation.kind == "CLIENT"
    prefill = _one(mine, name="rekv.v1.Prefill/Handoff")
    assert (prefill.kind, prefill.parent_id, prefill.service) == (
        "SERVER", negotiation.span_id, "rekv-prefill")
    on_prefill = _children(mine, prefill)
    assert set(on_prefill) == {"plan", "send"}
    sent = _children(mine, on_prefill["send"])
    assert set(sent) == {"control", "prefix_layers", "boundary"}
    assert [name for name, _ in sent["control"].events] == ["plan"]
    first_posted = min(at for s in sent.values() for _, at in s.events)
    assert sent["control"].events[0][1] == first_posted  # the plan goes first
    assert [name for name, _ in sent["prefix_layers"].events] == [
        f"layer.{i}" for i in range(CUT)]
    for child, parent in [*((s, generate_span) for s in top.values()),
                          *((s, handoff) for s in parts.values()), (prefill, negotiation),
                          *((s, prefill) for s in on_prefill.values()),
                          *((s, on_prefill["send"]) for s in sent.values())]:
        _inside(child, parent)
    assert top["first_token"].end_ns <= top["decode"].start_ns + SLACK_NS
    assert not any(s.failed for s in mine)


def test_the_spans_carry_the_action_bytes_times_and_plan(traced):
    spans, (trace_id, _), results = traced
    mine = [s for s in spans if s.trace_id == trace_id]
    summary = results["traced"].summary
    handoff = _one(mine, name="handoff").attributes
    assert (handoff["rekv.codec"], handoff["rekv.cut"], handoff["rekv.boundary"]) == (
        "int8", CUT, "bf16")
    assert handoff["rekv.fallback"] is False and "rekv.fallback_reason" not in handoff
    assert handoff["rekv.bytes_prefix"] == summary.bytes.prefix > 0
    assert handoff["rekv.bytes_boundary"] == summary.bytes.boundary > 0
    assert handoff["rekv.bytes_total"] > handoff["rekv.bytes_prefix"]
    assert handoff["rekv.predicted_ms"] > 0 and handoff["rekv.measured_ms"] > 0
    plan = _one(mine, name="plan").attributes
    assert (plan["rekv.codec"], plan["rekv.cut"]) == ("int8", CUT)
    assert plan["rekv.predicted_ms"] == pytest.approx(handoff["rekv.predicted_ms"], rel=1e-6)
    assert plan["rekv.link_gbps"] > 0 and plan["rekv.candidates"]
    assert plan["rekv.rule"] == "forced"  # the action the request named
    assert _one(mine, name="send").attributes["rekv.bytes_prefix"] == summary.bytes.prefix
    assert _one(mine, name="suffix").attributes["rekv.layers"] == 30 - CUT
    assert _one(mine, name="prefix_layers", service="rekv-decode").attributes[
        "rekv.layers"] == CUT
    assert _one(mine, name="first_token").attributes["rekv.ttft_ms"] > 0
    assert _one(mine, name="decode").attributes["rekv.tokens"] == len(
        results["traced"].token_ids)


def test_a_request_without_a_trace_context_starts_its_own(traced):
    spans, (trace_id, _), _ = traced
    roots = [s for s in spans if s.name == "rekv.v1.Decode/Generate" and s.trace_id != trace_id]
    untraced = next(s for s in roots if s.attributes["rekv.request_id"] == "untraced")
    assert untraced.parent_id == ""
    theirs = [s for s in spans if s.trace_id == untraced.trace_id]
    negotiation = _one(theirs, name="negotiation")
    assert _one(theirs, name="rekv.v1.Prefill/Handoff").parent_id == negotiation.span_id


def test_a_failed_handoff_says_why_and_shows_the_recompute(traced):
    spans, _, results = traced
    assert results["failed"].summary.fallback
    root = next(s for s in spans if s.name == "rekv.v1.Decode/Generate"
                and s.attributes["rekv.request_id"] == "flip_bit/failed")
    theirs = [s for s in spans if s.trace_id == root.trace_id]
    handoff = _one(theirs, name="handoff")
    assert handoff.attributes["rekv.fallback"] is True
    assert handoff.attributes["rekv.fallback_reason"].startswith("integrity")
    assert handoff.attributes["rekv.cut"] == 0  # recomputed here from the token ids
    assert set(_children(theirs, handoff)) == {"negotiation", "recompute"}
    assert not root.failed  # the request itself was served


def test_without_opentelemetry_the_services_serve_untraced_and_say_why(tmp_path):
    """A machine without the packages (the lent GPU machine) that is asked for traces: both
    services start, log why tracing is off, and serve."""
    hidden = ROOT / "tests" / "support" / "without_opentelemetry"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "PYTHONPATH": f"{hidden}:{ROOT}"}
    pair = ServicePair(SETTINGS, SETTINGS, log_dir=tmp_path, env=env)
    try:
        with grpc.insecure_channel(pair.decode_address) as channel:
            served = generate(channel, "untraced", PROMPT, 2, ("bf16", CUT))
    finally:
        codes = pair.stop()
    assert codes == {"decode": 0, "prefill": 0} and not served.summary.fallback
    for role in ("prefill", "decode"):
        log = (tmp_path / f"{role}.log").read_text()
        assert "OpenTelemetry is not installed" in log and "tracing is off" in log, log[-2000:]
