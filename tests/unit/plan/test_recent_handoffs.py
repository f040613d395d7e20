"""The decode side's memory of recent handoffs (`rekv_core.plan.recent`): the defaults the
calibration builds it with (16 handoffs a window, 10 minutes, a link within a factor 2), the edges
of age and link likeness, and which handoffs are filed at all and which correct their kind's
model (a handoff with no model, or no time, or no link, corrects nothing)."""

import pytest

from rekv_core.handoff import Action, ActionKind
from rekv_core.plan.evidence import Measured
from rekv_core.plan.recent import RecentHandoffs
from tests.support.clocks import HandClock

JOINT = Action("int8", 21, 30)


def _warm(recent, action=JOINT, prompt_len=1024, link_gbps=1.0):
    """The action's first handoff in its length bucket: the cold one, left out."""
    recent.observe(action, prompt_len, 10.0, 1000.0, link_gbps)


def test_by_default_a_window_holds_the_last_16_handoffs():
    recent = RecentHandoffs(clock=HandClock())
    _warm(recent)
    for measured in range(1, 18):  # 17 warm handoffs: the first drops out of the window
        recent.observe(JOINT, 1024, 1.0, float(measured), link_gbps=1.0)
    assert recent.measured(1024, 1.0) == {JOINT: Measured(9.5, 1024, 16)}  # median of 2..17
    assert recent.corrections(1.0) == {ActionKind.JOINT: pytest.approx(9.5)}


def test_by_default_handoffs_speak_for_ten_minutes_up_to_the_last_instant():
    clock = HandClock(1000.0)
    recent = RecentHandoffs(clock=clock)
    _warm(recent)
    recent.observe(JOINT, 1024, 10.0, 20.0, link_gbps=1.0)
    clock.now = 1600.0  # exactly 600 s old: still speaks
    assert recent.measured(1024, 1.0) == {JOINT: Measured(20.0, 1024, 1)}
    assert recent.corrections(1.0) == {ActionKind.JOINT: pytest.approx(2.0)}
    clock.now = 1600.5
    assert recent.measured(1024, 1.0) == {}
    assert recent.corrections(1.0) == {}


def test_by_default_a_link_within_a_factor_two_is_alike_both_ways():
    recent = RecentHandoffs(clock=HandClock())
    _warm(recent, link_gbps=2.0)
    recent.observe(JOINT, 1024, 10.0, 20.0, link_gbps=2.0)
    for alike in (1.0, 2.0, 4.0):  # a factor 2 exactly, either way, still alike
        assert recent.measured(1024, alike) == {JOINT: Measured(20.0, 1024, 1)}, alike
        assert recent.corrections(alike) == {ActionKind.JOINT: pytest.approx(2.0)}, alike
    for unlike in (0.8, 5.0):  # a factor 2.5: unlike
        assert recent.measured(1024, unlike) == {}, unlike
        assert recent.corrections(unlike) == {}, unlike


def test_a_handoff_without_time_or_link_is_not_filed():
    recent = RecentHandoffs(clock=HandClock())
    _warm(recent)
    recent.observe(JOINT, 1024, 10.0, 0.0, link_gbps=1.0)  # no time
    recent.observe(JOINT, 1024, 10.0, -3.0, link_gbps=1.0)
    recent.observe(JOINT, 1024, 10.0, 30.0, link_gbps=0.0)  # no link
    recent.observe(JOINT, 1024, 10.0, 30.0, link_gbps=-1.0)
    assert recent.measured(1024, 1.0) == {} and recent.corrections(1.0) == {}
    # nor does it count as the cold one of an action not seen yet
    other = Action("int8", 9, 30)
    recent.observe(other, 1024, 10.0, 0.0, link_gbps=1.0)
    recent.observe(other, 1024, 10.0, 30.0, link_gbps=0.0)
    recent.observe(other, 1024, 10.0, 40.0, link_gbps=1.0)  # the cold one
    assert recent.measured(1024, 1.0) == {}


def test_a_sub_millisecond_handoff_is_filed():
    recent = RecentHandoffs(clock=HandClock())
    _warm(recent)
    recent.observe(JOINT, 1024, 0.25, 0.5, link_gbps=1.0)
    assert recent.measured(1024, 1.0) == {JOINT: Measured(0.5, 1024, 1)}
    # a model under 1 ms still corrects its kind
    assert recent.corrections(1.0) == {ActionKind.JOINT: pytest.approx(2.0)}


def test_a_handoff_faster_than_modelled_corrects_its_kind_down():
    recent = RecentHandoffs(clock=HandClock())
    _warm(recent)
    recent.observe(JOINT, 1024, 40.0, 10.0, link_gbps=1.0)
    assert recent.corrections(1.0) == {ActionKind.JOINT: pytest.approx(0.25)}


def test_a_handoff_with_no_model_is_measured_but_corrects_nothing():
    recent = RecentHandoffs(clock=HandClock())
    _warm(recent)
    recent.observe(JOINT, 1024, 0.0, 30.0, link_gbps=1.0)
    assert recent.measured(1024, 1.0) == {JOINT: Measured(30.0, 1024, 1)}
    assert recent.corrections(1.0) == {}
    recent.observe(JOINT, 1024, 10.0, 20.0, link_gbps=1.0)
    assert recent.corrections(1.0) == {ActionKind.JOINT: pytest.approx(2.0)}  # 20 / 10 alone
