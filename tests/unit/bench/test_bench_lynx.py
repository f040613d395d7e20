"""bench/lynx.py's cases and its summary of one point: every codec in one stream whole and at every
cut, int8 as Lynx's streams at the same cuts, then the planner; each Lynx case is compared with the
same int8 action, the best Lynx case with the best other forced case, the planner with the best of
all, from the right rows; the drafts made and accepted are read from the decode worker's log, the
timed calls only."""

import pytest

from rekv_cli.bench.handoff import LinkRate
from rekv_cli.bench.link.report import row
from rekv_core.model.shapes import get_preset
from tests.support.paths import ROOT, load_script

lynx = load_script(ROOT / "bench" / "lynx.py", "lynx")
SHAPE = get_preset("smollm2-135m")


def test_the_cases_cover_each_codec_in_one_stream_int8_as_lynx_then_the_planner():
    cases = lynx.cases_for(30, [12, 21], ["int8", "bf16"])
    roles = [c["role"] for c in cases]
    assert roles.count("one stream") == 6 and roles.count("lynx") == 3
    assert [c["action"] for c in cases if c["role"] == "lynx"] == [
        ["int8", c, "bf16", 0, True] for c in (30, 12, 21)]
    assert cases[-1] == {"action": None, "schedule": None, "role": "planner"}


def _result(action, samples, kind, progressive=False):
    codec, cut = (action or ["int8", 30])[:2]
    return {"forced": action, "samples_ms": samples, "handoff_ms": samples,
            "predicted_ms": samples, "fallbacks": 0, "last_token_ms": [s + 400 for s in samples],
            "parts_ms": [dict.fromkeys("QHXRJ", 1.0)] * len(samples),
            "used": [[kind, codec, cut, True, 256, "bf16", False, 0, progressive]]
            * len(samples)}


def test_a_point_compares_lynx_with_its_int8_action_the_best_other_case_and_the_planner():
    rate = LinkRate(1, True)
    results = [("one stream", _result(["int8", 30], [900, 910, 905], "quant_transfer")),
               ("one stream", _result(["bf16", 12], [800, 790, 810], "bf16_recompute")),
               ("lynx", _result(["int8", 30, "bf16", 0, True], [600, 620, 610],
                                "quant_transfer", True)),
               ("planner", _result(None, [640, 650, 645], "quant_transfer", True))]
    rows = []
    for role, result in results:
        r = row(SHAPE, 512, rate, 0.05, result)
        r["role"], r["last_token_median_ms"] = role, result["last_token_ms"][1]
        rows.append(r)
    assert rows[2]["label"] == "int8 only+lynx streamed" and rows[2]["progressive"]
    assert rows[2]["bytes"] == rows[0]["bytes"]  # the same bytes, in another order
    rows[2]["drafted"], rows[2]["accepted"] = 12, 9
    point = lynx.point_summary(rows)
    (versus,) = point["lynx_over_int8"]
    assert versus["cut"] == 30 and versus["ttft"] == pytest.approx(610 / 905)
    assert versus["last_token"] == pytest.approx(1020 / 1310)  # the rows set above
    assert (versus["drafted"], versus["accepted"]) == (12, 9)
    assert point["best_lynx"]["median_ms"] == 610 and point["best_other"]["median_ms"] == 800
    assert point["planner_over_best"] == pytest.approx(645 / 610)
    assert point["planner_within_10pct"]


def test_drafts_are_summed_over_the_timed_calls_of_the_case(tmp_path):
    log = tmp_path / "decode.log"
    log.write_text("x INFO rekv.decode: request=link-512-3-0 lynx drafted=4 accepted=1 emitted=2\n"
                   "x INFO rekv.decode: request=link-512-3-1 lynx drafted=5 accepted=5 emitted=6\n"
                   "x INFO rekv.decode: request=link-512-3-2 lynx drafted=3 accepted=2 emitted=3\n"
                   "x INFO rekv.decode: request=link-512-13-2 lynx drafted=7 accepted=7 "
                   "emitted=8\n")
    assert lynx.drafts_in_log(log, 512, 3, warmups=1) == (8, 7)
    assert lynx.drafts_in_log(log, 512, 4, warmups=1) is None
    assert lynx.drafts_in_log(tmp_path / "absent.log", 512, 3, warmups=1) is None
