"""The stretch of decode-side compute interleaved with a running batch (`plan.cost`)."""

import pytest

from rekv_core.plan.stretch import MAX_STRETCH, interleaved_stretch


def test_no_batch_or_no_engine_stretches_nothing():
    assert interleaved_stretch(0, 150.0, 120.0) == 1.0
    assert interleaved_stretch(4, 0.0, 120.0) == 1.0


def test_a_turn_gets_what_the_batchs_step_leaves_of_the_budget():
    assert interleaved_stretch(1, 150.0, 50.0) == pytest.approx(1.5)
    assert interleaved_stretch(8, 150.0, 120.0) == pytest.approx(5.0)
    assert interleaved_stretch(8, 150.0, 100.0) < interleaved_stretch(16, 150.0, 120.0)


def test_a_step_at_or_past_the_budget_is_capped():
    """Each turn still runs its smallest piece, so the stretch stays finite."""
    assert interleaved_stretch(32, 150.0, 150.0) == MAX_STRETCH
    assert interleaved_stretch(32, 150.0, 400.0) == MAX_STRETCH
    assert interleaved_stretch(32, 150.0, 140.0) == MAX_STRETCH  # 15 > 10: capped as well


def test_a_sub_millisecond_budget_still_stretches():
    """Any positive budget gives turns: a 0.5 ms budget beside a 0.1 ms step stretches by 1.25."""
    assert interleaved_stretch(2, 0.5, 0.1) == pytest.approx(1.25)
