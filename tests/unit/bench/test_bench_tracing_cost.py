"""bench/tracing_cost.py's span-code loop: the calls it times for one request make the spans the
services make (the tree `tests/system/test_tracing.py` checks), and its report reads its rows."""

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.tracing import TRACING_OFF
from services.tracing_sdk import SdkTracing
from tests.support.paths import ROOT, load_script

tracing_cost = load_script(ROOT / "bench" / "tracing_cost.py", "tracing_cost")


def test_one_timed_request_makes_every_span_of_both_services():
    exporter = InMemorySpanExporter()
    tracing = SdkTracing("bench", exporter)
    fixtures = tracing_cost._fixtures(64)
    tracing_cost.decode_request(tracing, fixtures)
    tracing_cost.prefill_request(tracing, fixtures)
    tracing.shutdown()
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == sorted([
        "rekv.v1.Decode/Generate", "admission", "handoff", "negotiation", "boundary",
        "prefix_layers", "suffix", "join", "first_token", "decode",
        "rekv.v1.Prefill/Handoff", "plan", "send", "control", "prefix_layers", "boundary"])
    sent = [s for s in exporter.get_finished_spans() if s.name == "prefix_layers"
            and s.events]
    assert [e.name for e in sent[0].events] == [f"layer.{i}" for i in range(tracing_cost.CUT)]
    exporter = InMemorySpanExporter()  # the last one was shut down with its provider
    tracing = SdkTracing("bench", exporter)
    tracing_cost.prefill_request(tracing, fixtures, span_per_message=True)
    tracing.shutdown()
    spans = [s.name for s in exporter.get_finished_spans()]
    assert [f"layer.{i}" for i in range(tracing_cost.CUT)] == [s for s in spans if "layer" in s]
    tracing_cost.decode_request(TRACING_OFF, fixtures)  # off: nothing to keep, nothing raised
    tracing_cost.prefill_request(TRACING_OFF, fixtures)


def test_the_span_code_rows_and_report():
    code = tracing_cost.span_code(requests=3, rounds=2, prompt_tokens=32)
    rows = {row["case"]: row for row in code["rows"]}
    assert list(rows) == ["none", "off", "on", "on, a span per message"]
    assert all(len(row["samples_s"]) == 2 for row in rows.values())
    assert rows["none"]["us_beyond_none"] == 0.0
    assert rows["on"]["us_per_request"] > rows["none"]["us_per_request"]
    text = tracing_cost.report({"machine": {"cpu": "c", "cores": 2, "torch": "t", "commit": "x",
                                            "tree_clean": True, "started": "now"},
                                "command": "python bench/tracing_cost.py",
                                "shared_machine": True, "span_code": code})
    assert "| off |" in text and "| on |" in text and "shared with other work" in text
