"""bench/fixed_cost.py's reading of a request's trace: the instants on its critical path, taken
from the right spans of both services, and phases that add up to the TTFT the trace spans."""

import pytest

from rekv_cli.bench.otlp_collector import CollectedSpan
from tests.support.paths import ROOT, load_script

fixed_cost = load_script(ROOT / "bench" / "fixed_cost.py", "fixed_cost")
MS = 1_000_000


def _span(name, span_id, parent, start, end, service="rekv-decode", events=(), **attributes):
    return CollectedSpan(service, name, "t" * 32, span_id, parent, "INTERNAL", start * MS,
                         end * MS, attributes, [(event, at * MS) for event, at in events], False)


def _trace():
    """A request whose instants are 0, 1, 3, 6, … ms apart (each gap one more than the last)."""
    return [
        _span("rekv.v1.Decode/Generate", "g", "", 0, 200),
        _span("admission", "a", "g", 0, 1),
        _span("handoff", "h", "g", 3, 150,
              **{"rekv.codec": "int8", "rekv.cut": 12, "rekv.bytes_total": 3_000_000,
                 "rekv.measured_ms": 52.0}),
        _span("negotiation", "n", "h", 6, 90),
        _span("rekv.v1.Prefill/Handoff", "p", "n", 10, 88, service="rekv-prefill"),
        _span("plan", "pl", "p", 15, 21, service="rekv-prefill",
              **{"rekv.link_gbps": 8.0, "rekv.predicted_ms": 39.0}),
        _span("send", "s", "p", 28, 55, service="rekv-prefill", **{"rekv.prefill_ms": 20.0}),
        _span("control", "c", "s", 36, 36, service="rekv-prefill", events=[("plan", 36)]),
        _span("boundary", "b", "s", 45, 45, service="rekv-prefill", events=[("boundary", 45)]),
        _span("prefix_layers", "l", "s", 50, 54, service="rekv-prefill",
              events=[("layer.0", 50), ("layer.1", 54)]),
        _span("suffix", "x", "h", 46, 60, **{"rekv.compute_ms": 12.0}),
        _span("join", "j", "h", 60, 66),
        _span("first_token", "f", "g", 70, 78),
    ]


def test_the_instants_come_from_both_services_spans_and_the_phases_add_up():
    row = fixed_cost.breakdown(_trace())
    gaps = list(row["phases_ms"].values())
    assert list(row["phases_ms"]) == list(fixed_cost.PHASES.values())
    assert gaps == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0]
    assert sum(gaps) == row["ttft_ms"] == 78.0
    assert row["prefill_ms"] == 20.0 and row["beyond_prefill_ms"] == 58.0
    assert row["action"] == "int8/12"


def test_the_compute_on_both_sides_and_the_wire_set_the_goals_ratio():
    """20 ms of prefill and 12 of recompute; 3 MB at 8 Gb/s is 3 ms on the wire: the 78 ms TTFT
    is 78 / 35 of compute plus wire. The plan's 39 ms against the 52 ms handoff and the 78 ms
    TTFT. Without a suffix (the prefill ran every layer) the decode side computed nothing."""
    row = fixed_cost.breakdown(_trace())
    assert row["decode_compute_ms"] == 12.0 and row["compute_ms"] == 32.0
    assert row["beyond_compute_ms"] == 46.0
    assert row["wire_ms"] == pytest.approx(3.0)
    assert row["over_compute_and_wire"] == pytest.approx(78.0 / 35.0)
    assert (row["predicted_ms"], row["measured_handoff_ms"]) == (39.0, 52.0)
    assert row["predicted_over_handoff"] == 0.75 and row["predicted_over_ttft"] == 0.5
    whole = fixed_cost.breakdown([s for s in _trace() if s.name != "suffix"])
    assert whole["decode_compute_ms"] == 0.0 and whole["compute_ms"] == 20.0


def test_a_trace_missing_a_span_or_its_messages_is_named():
    spans = [s for s in _trace() if s.name != "join"]
    with pytest.raises(ValueError, match=r"join: 0 spans in the trace, want 1"):
        fixed_cost.breakdown(spans)
    only_plan = [s for s in _trace() if s.name not in ("boundary", "prefix_layers")]
    with pytest.raises(ValueError, match="send: 1 message events under it"):
        fixed_cost.breakdown(only_plan)


def test_every_mode_gets_one_wave_a_round_in_an_order_shuffled_per_round():
    order = fixed_cost.wave_modes(["planner", "bf16/0", "bf16/30"], 20, seed=3)
    assert len(order) == 60
    rounds = [order[i:i + 3] for i in range(0, 60, 3)]
    assert all(sorted(r) == ["bf16/0", "bf16/30", "planner"] for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # not one fixed order
    assert order == fixed_cost.wave_modes(["planner", "bf16/0", "bf16/30"], 20, seed=3)


def test_a_mode_is_the_planner_or_a_forced_action_and_anything_else_is_named():
    assert fixed_cost.forced_action("planner") is None
    assert fixed_cost.forced_action("splitzip/21") == ("splitzip", 21)
    for bad in ("bf16", "bf16/x", "/3", "planer"):
        with pytest.raises(ValueError, match=f"mode {bad!r}"):
            fixed_cost.forced_action(bad)


def test_a_modes_summary_is_the_median_of_its_own_requests():
    rows = [fixed_cost.breakdown(_trace()) for _ in range(3)]
    for row, ttft in zip(rows, (10.0, 30.0, 20.0)):
        row["ttft_ms"], row["summary_ttft_ms"] = ttft, ttft
    rows[0]["phases_ms"]["admission"] = 100.0
    rows[1]["predicted_over_handoff"] = None  # no handoff measured: left out of the median
    rows[2]["predicted_over_handoff"] = 2.0
    summary = fixed_cost.summarize(rows)
    assert summary["median"]["ttft_ms"] == 20.0
    assert summary["median"]["predicted_over_handoff"] == (0.75 + 2.0) / 2
    assert summary["median_phases_ms"]["admission"] == 1.0
    assert summary["median_phases_ms"]["first token"] == 12.0
