"""bench/token_split.py's cases and its summary of one point: every codec sent whole, joint and
split at every cut with splits on the block grid below the prompt; the best split is compared with
the best of the other forced cases, the planner with the best of all, from the right rows."""

import pytest

from rekv_cli.bench.handoff import LinkRate
from rekv_cli.bench.link.report import row
from rekv_core.model.shapes import get_preset
from tests.support.paths import ROOT, load_script

token_split = load_script(ROOT / "bench" / "token_split.py", "token_split")
SHAPE = get_preset("smollm2-135m")


def test_the_cases_cover_each_codec_whole_joint_and_split_then_the_planner():
    assert token_split.splits_for(512) == [256]
    assert token_split.splits_for(2048) == [256, 1024]
    assert token_split.splits_for(300) == [256]
    cases = token_split.cases_for(30, 2048, [12, 21], ["int8", "bf16"])
    roles = [c["role"] for c in cases]
    assert roles.count("whole") == 2 and roles.count("joint") == 4 and roles.count("split") == 8
    assert cases[-1] == {"action": None, "schedule": None, "role": "planner"}
    assert ["int8", 21, "bf16", 1024] in [c["action"] for c in cases]


def _result(action, samples, kind, split=0):
    codec, cut = (action or ["bf16", 15])[:2]
    return {"forced": action, "samples_ms": samples, "handoff_ms": samples,
            "predicted_ms": samples, "fallbacks": 0, "last_token_ms": [s + 400 for s in samples],
            "parts_ms": [dict.fromkeys("QHXRJ", 1.0)] * len(samples),
            "used": [[kind, codec, cut, True, 256, "bf16", False, split]] * len(samples)}


def test_a_point_compares_the_best_split_with_the_best_other_case_and_the_planner():
    rate = LinkRate(1, True)
    results = [("whole", _result(["int8", 30], [900, 910, 905], "quant_transfer")),
               ("joint", _result(["int8", 12], [800, 790, 810], "joint")),
               ("split", _result(["int8", 12, "bf16", 256], [700, 720, 710], "token_split", 256)),
               ("split", _result(["int8", 21, "bf16", 256], [950, 940, 960], "token_split", 256)),
               ("planner", _result(None, [760, 770, 765], "token_split", 256))]
    rows = []
    for role, result in results:
        r = row(SHAPE, 512, rate, 0.05, result)
        r["role"], r["last_token_median_ms"] = role, result["last_token_ms"][1]
        rows.append(r)
    assert rows[2]["label"] == "int8 c=12 l=256 chunked" and rows[2]["split"] == 256
    point = token_split.point_summary(rows)
    assert point["best_split"]["median_ms"] == 710 and point["best_other"]["median_ms"] == 800
    assert point["split_over_other"] == pytest.approx(710 / 800)
    assert point["split_over_other_last_token"] == pytest.approx(1120 / 1190)
    assert point["planner_over_best"] == pytest.approx(765 / 710)
    assert point["planner_within_10pct"]
