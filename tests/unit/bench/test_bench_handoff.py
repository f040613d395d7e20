"""`rekv bench handoff`: its statistics and its sweep. The command itself on a small real run,
and its JSON: tests/system/test_bench_handoff.py."""

import random
import statistics

import pytest

from rekv_cli.bench.handoff import (BenchConfig, LinkRate, cases_for, default_cuts,
                                    overlap_vs_sequential)
from rekv_cli.bench.stats import median_ci, paired_ratio
from rekv_core.handoff import ReceiveMode
from rekv_core.handoff.action import ActionKind


def test_median_ci_brackets_the_median_and_narrows_with_agreement():
    samples = [10.0, 11.0, 12.0, 13.0, 50.0, 9.0, 10.5, 11.5, 12.5, 10.2]
    median, (low, high) = median_ci(samples)
    assert median == statistics.median(samples)
    assert low <= median <= high
    assert high < 50.0  # the outlier does not drag the median's interval
    assert median_ci([7.0] * 12) == (7.0, (7.0, 7.0))
    # seeded: a committed interval is recomputed from its samples, whatever the global random
    # state; with 20 resamples each seed gives its own interval (pinned: any other draw differs)
    assert (low, high) == (10.2, 12.5)
    state = random.getstate()
    try:
        for global_seed in (1, 2):
            random.seed(global_seed)
            assert median_ci(samples, resamples=20) == (11.25, (10.35, 12.25))
    finally:
        random.setstate(state)
    assert median_ci(samples, resamples=20, seed=3) == (11.25, (10.0, 13.0))
    with pytest.raises(ValueError, match="samples"):
        median_ci([])


def test_paired_ratios_cancel_a_drift_the_cases_share():
    """Two cases run once per round on a machine whose speed drifts by 2x between rounds: each
    case's own median is spread over the drift, the ratio of the same round is not."""
    drift = [1.0, 1.5, 2.0, 1.2, 1.8, 1.1, 1.6]
    fast = [100.0 * d for d in drift]
    slow = [110.0 * d for d in drift]
    ratio, (low, high) = paired_ratio(slow, fast)
    assert ratio == pytest.approx(1.1) and high - low == pytest.approx(0.0, abs=1e-12)
    _, (own_low, own_high) = median_ci(slow)
    assert own_high / own_low > 1.3  # unpaired, the drift swamps the 10%
    with pytest.raises(ValueError, match="one numerator per denominator"):
        paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="denominators"):
        paired_ratio([1.0], [0.0])


def test_link_rates_parse_and_scale():
    assert LinkRate.parse("x2").gbps(0.25) == 0.5
    assert LinkRate.parse("10").gbps(0.25) == 10.0
    assert LinkRate.parse("x0.5").label == "x0.5"
    for bad in ("fast", "x", "-1", "x0"):
        with pytest.raises(ValueError, match="link-gbps"):
            LinkRate.parse(bad)


def test_sweep_covers_every_action_kind_and_both_schedules():
    cases = cases_for(30, BenchConfig())
    assert {c.action.kind for c in cases} == set(ActionKind)
    assert default_cuts(30) == [6, 12, 18, 24]
    joint_int8 = {c.action.cut for c in cases if c.action.codec == "int8" and
                  c.action.kind == ActionKind.JOINT and c.mode is ReceiveMode.SEQUENTIAL}
    assert joint_int8 == {6, 12, 18, 24}
    with pytest.raises(ValueError, match="cuts"):
        cases_for(30, BenchConfig(cuts=[30]))


def test_overlap_pairs_only_rows_of_the_same_action():
    """The joint action and the token split share codec and cut: the sequential joint row pairs
    with the overlapped joint row, never with the token split's (which has no sequential row)."""
    def row(action, schedule, median):
        return {"prompt_len": 2048, "link": "x1", "action": action, "codec": "int8", "cut": 18,
                "schedule": schedule, "median_ms": median, "model_ms": median + 1.0,
                "measured_over_model": median / (median + 1.0)}
    rows = [row("joint", "overlap", 3759.0), row("joint", "sequential", 5519.0),
            row("token_split", "overlap", 2734.0)]
    for ordered in (rows, rows[::-1]):
        (pair,) = overlap_vs_sequential(ordered)
        assert pair["action"] == "joint"
        assert (pair["overlap_ms"], pair["sequential_ms"]) == (3759.0, 5519.0)
        assert pair["sequential_over_overlap"] == 5519.0 / 3759.0
        assert pair["overlap_model_ms"] == 3760.0
