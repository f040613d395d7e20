"""The receiver's link sample from message arrivals: only back-to-back runs time the wire."""

import pytest

from rekv_core.transport.arrivals import PROMPT, Arrival, link_sample

MB = 1_000_000


def _queued(start: float, count: int, seconds_each: float, nbytes: int = MB):
    """Messages waiting each time the reader looked: one lands every `seconds_each`."""
    return [Arrival(10e-6, True, 20e-6, start + (i + 1) * seconds_each, nbytes)
            for i in range(count)]


def _came(at: float, window: float, nbytes: int = MB):
    """A message that arrived while the reader was looking, seen within `window`."""
    return Arrival(0.0, False, window, at, nbytes)


def test_a_back_to_back_run_times_the_wire_from_its_anchor():
    plan = _came(0.0, 0.001, 300)  # may have landed up to 1 ms before it was seen
    nbytes, seconds = link_sample([plan, *_queued(0.0, 10, 0.001)])  # 1 MB a ms: 8 Gb/s
    assert nbytes == 10 * MB
    assert seconds == pytest.approx(0.0105)  # half the anchor's uncertainty added
    assert nbytes * 8 / seconds / 1e9 == pytest.approx(7.6, rel=0.01)


def test_messages_the_sender_held_back_time_nothing():
    # each came while the reader was looking: the wire idled before it (the sender encoded)
    assert link_sample([_came(0.002 * i, 0.0004) for i in range(10)]) is None


def test_a_run_too_short_for_its_anchor_is_dropped():
    assert link_sample([_came(0.0, 0.001, 300), *_queued(0.0, 2, 0.001)]) is None


@pytest.mark.parametrize("late", [
    Arrival(PROMPT * 10, True, 20e-6, 0.006, MB),  # the reader waited for the consumer
    Arrival(10e-6, True, PROMPT * 10, 0.006, MB),  # its first look took long (no core)
], ids=["held", "slow-look"])
def test_what_waited_for_a_late_reader_ends_the_run_and_starts_none(late):
    plan = _came(0.0, 0.0001, 300)
    first = _queued(0.0, 5, 0.001)
    after = [late, *_queued(0.006, 4, 0.001)]
    nbytes, seconds = link_sample([plan, *first, *after])
    assert nbytes == 5 * MB and seconds == pytest.approx(0.00505)
    # a later message that came while the reader looked anchors a new run
    pause = _came(0.020, 0.0001)
    nbytes, seconds = link_sample([plan, *first, *after, pause, *_queued(0.020, 4, 0.002)])
    assert nbytes == 9 * MB and seconds == pytest.approx(0.00505 + 0.00805)


def test_no_arrivals_no_sample():
    assert link_sample([]) is None
    assert link_sample([_came(0.0, 0.001, 300)]) is None
