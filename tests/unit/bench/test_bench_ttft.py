"""`rekv bench ttft`'s cases and summaries: every schedule has its cases, splitzip adds
boundary-coded joint actions, and a codec's gain compares best cases. The command at a tiny size
(every schedule's cases run, the lossless ones give the colocated prefill's first token, and a
point's summary is the best case of each schedule): tests/system/test_commands.py."""

import pytest

from rekv_cli.bench.handoff import LinkRate
from rekv_cli.bench.ttft import SCHEDULES, TtftConfig, Way, cases_for
from rekv_core.handoff import Action


def test_cases_cover_every_schedule():
    cases = cases_for(30, TtftConfig(cuts=[10, 20], codecs=["int8"], chunk_tokens=256))
    by = {s: [c for c in cases if c.way.value == s] for s in SCHEDULES}
    assert [c.action for c in by["colocated"]] == [None]
    assert [(c.action.codec, c.action.cut) for c in by["baseline"]] == [("bf16", 30)]
    streamed = {(c.action.codec, c.action.cut) for c in by["streamed"]}
    assert streamed == {("bf16", 30), ("bf16", 0), ("bf16", 20), ("int8", 30), ("int8", 10),
                        ("int8", 20)}
    assert {(c.action.codec, c.action.cut) for c in by["seed"]} == streamed - {("bf16", 30)}
    # chunking is for the actions with a boundary
    assert all(0 < c.action.cut < 30 and c.chunk_tokens == 256 for c in by["chunked"])
    assert [c.action for c in by["pipelined"]] == [c.action for c in by["chunked"]]
    spectrum = cases_for(30, TtftConfig(cuts=[10], codecs=["spectrum30"]))
    assert not any(c.way is Way.PIPELINED and c.action.codec == "spectrum30"
                   for c in spectrum)  # it ranks a layer's tokens: no chunk encodes alone
    assert LinkRate.parse("x4").gbps(0.5) == 2.0


def test_splitzip_adds_boundary_coded_joint_actions():
    actions = {c.action for c in cases_for(30, TtftConfig(cuts=[10], codecs=["int8", "splitzip"]))
               if c.action is not None}
    assert {a for a in actions if a.boundary == "splitzip"} == {
        Action("int8", 10, 30, "splitzip")}


def _row(label, codec, cut, ms, boundary="bf16", schedule="chunked"):
    return {"label": label, "codec": codec, "cut": cut, "median_ms": ms, "boundary": boundary,
            "schedule": schedule}


def test_codec_gains_compare_the_best_with_and_without_each_option():
    from rekv_cli.bench.ttft import codec_gains

    rows = [_row("baseline", "bf16", 30, 50.0, schedule="baseline"),
            _row("colocated", None, None, 10.0, boundary=None, schedule="colocated"),
            _row("int8/15", "int8", 15, 40.0), _row("int4h/15", "int4h", 15, 32.0),
            _row("spectrum50/15", "spectrum50", 15, 44.0),
            _row("int8/15+zb", "int8", 15, 36.0, boundary="splitzip")]
    gains = codec_gains(rows)
    assert gains["base"] == {"label": "int8/15", "median_ms": 40.0}
    assert gains["int4h"]["base_over_best"] == pytest.approx(40 / 32)
    assert gains["spectrum50"] == {"label": "int8/15", "median_ms": 40.0, "base_over_best": 1.0}
    assert gains["splitzip boundary"]["label"] == "int8/15+zb"
