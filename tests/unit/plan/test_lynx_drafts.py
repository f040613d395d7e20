"""The number of drafts on Lynx's anchor cache: as many steps as fit before the residuals land
(never one that would end after them), none when they land first, never more than the cap (0
turns drafting off; a negative cap is refused)."""

import pytest

from rekv_core.plan.lynx_drafts import MAX_DRAFTS, draft_count


def test_drafts_fill_the_wait_for_the_residuals():
    assert draft_count(residual_wait_ms=250.0, step_ms=60.0) == 4
    assert draft_count(residual_wait_ms=59.0, step_ms=60.0) == 0
    assert draft_count(residual_wait_ms=-5.0, step_ms=60.0) == 0
    assert draft_count(residual_wait_ms=1e6, step_ms=1.0) == MAX_DRAFTS
    assert draft_count(residual_wait_ms=1e6, step_ms=1.0, max_drafts=2) == 2
    with pytest.raises(ValueError, match="step_ms"):
        draft_count(100.0, 0.0)


def test_the_drafts_never_outlast_the_wait():
    # wait and step in tenths of a millisecond: the drafts finish by the time the residuals land
    # (k steps <= wait, as float arithmetic adds them up), however near a multiple the wait is
    for wait in [w / 10 for w in range(0, 200)]:
        for step in [s / 10 for s in range(1, 40)]:
            k = draft_count(wait, step, max_drafts=1000)
            assert k * step <= wait, (wait, step, k)
    assert draft_count(3.9, 1.3, max_drafts=1000) == 2  # 3 steps of 1.3 end just past 3.9


def test_no_draft_when_the_residuals_land_before_one_step():
    assert draft_count(residual_wait_ms=0.0, step_ms=0.5) == 0
    assert draft_count(residual_wait_ms=0.4, step_ms=0.5) == 0
    assert draft_count(residual_wait_ms=-5.0, step_ms=0.5) == 0


def test_a_cap_of_zero_turns_drafting_off_and_a_negative_cap_is_refused():
    assert draft_count(residual_wait_ms=250.0, step_ms=60.0, max_drafts=0) == 0
    with pytest.raises(ValueError, match=r"max_drafts: must be >= 0, got -1"):
        draft_count(250.0, 60.0, max_drafts=-1)
