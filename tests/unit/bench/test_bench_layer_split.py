"""bench/layer_split.py's cases and its summary of one point: every codec whole and at every cut,
the same in the per-layer form at the largest l below S, then the planner; each per-layer case is
compared with the same action without the form, the best per-layer case with the best other forced
case, the planner with the best of all, from the right rows; below two blocks no l is allowed."""

import math

import pytest

from rekv_cli.bench.handoff import LinkRate
from rekv_cli.bench.link.report import row
from rekv_core.model.shapes import get_preset
from tests.support.paths import ROOT, load_script

bench = load_script(ROOT / "bench" / "layer_split.py", "layer_split")
SHAPE = get_preset("mini-llama-2-7b")


def test_the_cases_cover_each_codec_whole_and_in_the_form_then_the_planner():
    cases = bench.cases_for(32, 2048, [13, 22], ["bf16", "int8"])
    roles = [c["role"] for c in cases]
    assert roles.count("whole") == 6 and roles.count("layer_split") == 6
    assert [c["action"] for c in cases if c["role"] == "layer_split"][:3] == [
        ["bf16", c, "bf16", 0, False, 1792] for c in (32, 13, 22)]
    assert cases[-1] == {"action": None, "schedule": None, "role": "planner"}
    assert bench.largest_split(512) == 256 and bench.largest_split(257) == 256
    assert not any(c["role"] == "layer_split" for c in bench.cases_for(32, 256, [13], ["bf16"]))


def _result(action, samples, kind, layer_split=0):
    codec, cut = (action or ["bf16", 32])[:2]
    return {"forced": action, "samples_ms": samples, "handoff_ms": samples,
            "predicted_ms": samples, "fallbacks": 0, "last_token_ms": [s + 400 for s in samples],
            "parts_ms": [dict.fromkeys("QHXRJ", 1.0)] * len(samples),
            "used": [[kind, codec, cut, True, 256, "bf16", False, 0, False, layer_split]]
            * len(samples)}


def _rows(results):
    rows = []
    for role, result in results:
        r = row(SHAPE, 512, LinkRate(1, True), 0.05, result)
        r["role"], r["last_token_median_ms"] = role, result["last_token_ms"][1]
        rows.append(r)
    return rows


def test_a_point_compares_the_form_with_its_action_the_best_other_case_and_the_planner():
    rows = _rows([("whole", _result(["bf16", 32], [900, 910, 905], "bf16_transfer")),
                  ("whole", _result(["int8", 13], [800, 790, 810], "joint")),
                  ("layer_split", _result(["bf16", 32, "bf16", 0, False, 256], [600, 620, 610],
                                          "bf16_transfer", 256)),
                  ("planner", _result(None, [640, 650, 645], "bf16_transfer", 256))])
    assert rows[2]["layer_split"] == 256 and rows[2]["label"].startswith("BF16+ls256")
    assert rows[2]["bytes"] < rows[0]["bytes"]  # MHA: half of rows [0, 256) come off the wire
    point = bench.point_summary(rows)
    (versus,) = point["split_over_whole"]
    assert versus["cut"] == 32 and versus["ttft"] == pytest.approx(610 / 905)
    assert versus["last_token"] == pytest.approx(1020 / 1310)
    assert versus["bytes"] == pytest.approx(rows[2]["bytes"] / rows[0]["bytes"])
    assert point["best_split"]["median_ms"] == 610 and point["best_other"]["median_ms"] == 800
    assert point["split_over_other"] == pytest.approx(610 / 800)
    assert point["planner_over_best"] == pytest.approx(645 / 610)
    assert point["planner_within_10pct"]


def test_a_point_without_an_allowed_l_has_no_split_figures():
    point = bench.point_summary(_rows([
        ("whole", _result(["bf16", 32], [900, 910, 905], "bf16_transfer")),
        ("planner", _result(None, [880, 890, 885], "bf16_transfer"))]))
    assert point["best_split"] is None and math.isnan(point["split_over_other"])
    assert "nan" in bench.markdown({"meta": {k: "x" for k in (
        "model", "dtype", "command", "commit", "tree_clean", "machine", "link", "runs",
        "warmups", "new_tokens")}, "points": [{"prompt_len": 256, "link": "x1", "link_gbps": 1.0,
                                              **point}], "rows": []})
