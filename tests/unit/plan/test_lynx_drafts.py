"""The number of drafts on Lynx's anchor cache: as many steps as fit before the residuals land,
none when they land first, never more than the cap."""

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
