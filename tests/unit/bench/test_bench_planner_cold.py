"""bench/planner_cold.py's summary of one point: its ratios come from the right samples."""


import pytest

from tests.support.paths import ROOT, load_script

planner_cold = load_script(ROOT / "bench" / "planner_cold.py", "planner_cold")


def _forced(case, samples):
    schedule = case["schedule"] or [True, 256]
    used = ["joint", *case["action"], schedule[0], schedule[1], "bf16", schedule[2:] == [True]]
    return {"forced": case["action"], "schedule": case["schedule"], "samples_ms": samples,
            "used": [used]}


def test_a_point_is_judged_on_its_first_request_and_the_median_of_the_rest():
    cases = planner_cold.CASES
    forced = [_forced(case, [1000.0 + 10 * i, 1010.0 + 10 * i, 990.0 + 10 * i])
              for i, case in enumerate(cases)]
    forced[3]["samples_ms"] = [700.0, 720.0, 710.0]  # token-only, streamed: the best
    planner = {"samples_ms": [900.0, 760.0, 800.0, 770.0],
               "used": [["token_recompute", "bf16", 0]] * 4}
    point = planner_cold.summarize_point({"link_gbps": 0.5, "prompt_len": 600}, planner, forced,
                                         {}, None)
    assert point["best"]["action"] == ["bf16", 0] and point["best"]["median_ms"] == 710.0
    assert [m["schedule"] for m in point["forced"]][:2] == ["seed", "streamed"]
    assert [m["schedule"] for m in point["forced"]][-2:] == ["pipelined", "pipelined"]
    assert point["first_over_baseline"] == pytest.approx(900 / 1000)
    assert point["first_action_warm_over_baseline"] == pytest.approx(710 / 1000)
    assert point["later_median_ms"] == 770.0
    assert point["later_over_best"] == pytest.approx(770 / 710)
    assert point["first_ok"] and point["later_ok"] == (770 <= 1.1 * 710)
    assert "| 0.71 |" in planner_cold.markdown({"meta": {"machine": "m", "commit": "c",
                                                         "seed": 1, "command": "x"},
                                                "points": [point]})
