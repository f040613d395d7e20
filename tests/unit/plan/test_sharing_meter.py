"""How many requests shared the decode worker's compute (`rekv_core.plan.sharing.SharingMeter`),
on a clock moved by hand: the mean count over an interval, its edges (two periods, the history,
intervals that begin between samples or end after the last one), and the sampling thread."""

import threading

import pytest

from rekv_core.plan.sharing import SharingMeter
from tests.support.clocks import HandClock


def _run(meter, clock, count, steps, step_s, value):
    count["now"] = value
    for _ in range(steps):
        clock.now += step_s
        meter.sample()


def test_by_default_an_interval_of_a_few_hundredths_of_a_second_is_averaged():
    """The worker's meter samples every 10 ms: a 50 ms suffix gets the count it ran with, not
    the count when it ended."""
    count, clock = {"now": 0}, HandClock()
    meter = SharingMeter(lambda: count["now"], clock=clock, start=False)
    _run(meter, clock, count, 5, 0.01, 3)
    count["now"] = 1
    assert meter.average(0.0, 0.05) == pytest.approx(3.0)


def test_by_default_the_history_is_five_minutes():
    """Sampled every second, the meter holds the last 300 s: an interval that begins before
    them gets the count now; one inside them, its mean."""
    count, clock = {"now": 0}, HandClock()
    meter = SharingMeter(lambda: count["now"], period_s=1.0, clock=clock, start=False)
    _run(meter, clock, count, 150, 1.0, 3)  # (0, 150]: 3
    _run(meter, clock, count, 150, 1.0, 1)  # (150, 300]: 1
    count["now"] = 5
    assert meter.average(0.0, 300.0) == 5.0  # its start has left the history
    assert meter.average(1.0, 300.0) == pytest.approx((3 * 149 + 150) / 299)
    assert meter.average(100.0, 200.0) == pytest.approx(2.0)


def test_a_short_history_drops_what_is_older_than_it():
    count, clock = {"now": 0}, HandClock()
    meter = SharingMeter(lambda: count["now"], period_s=0.25, history_s=0.5, clock=clock,
                         start=False)
    _run(meter, clock, count, 3, 0.25, 3)  # samples at 0.25, 0.5, 0.75
    count["now"] = 1
    assert meter.average(0.25, 0.75) == 1.0  # 0.25 is more than 0.5 s before the last sample
    assert meter.average(0.5, 1.0) == 1.0  # too short: one period of history


def test_two_periods_are_long_enough_to_average():
    count, clock = {"now": 0}, HandClock()
    meter = SharingMeter(lambda: count["now"], period_s=0.25, clock=clock, start=False)
    _run(meter, clock, count, 4, 0.25, 3)
    count["now"] = 1
    assert meter.average(0.0, 0.5) == 3.0
    assert meter.average(0.5, 0.99) == 1.0  # under two periods: the count now


def test_an_interval_may_begin_between_samples_and_end_after_the_last():
    """The integral is linear between samples, and holds its last value after the last one (the
    interval is cut there)."""
    count, clock = {"now": 0}, HandClock()
    meter = SharingMeter(lambda: count["now"], period_s=0.25, clock=clock, start=False)
    _run(meter, clock, count, 2, 0.25, 3)  # (0, 0.5]: 3
    _run(meter, clock, count, 2, 0.25, 1)  # (0.5, 1.0]: 1
    count["now"] = 7
    assert meter.average(0.125, 1.0) == pytest.approx((3 * 0.375 + 1 * 0.5) / 0.875)
    assert meter.average(0.0, 10.0) == pytest.approx(2.0)  # 1.0 is the last sample
    assert meter.average(0.5, 10.0) == pytest.approx(1.0)


def test_the_meter_samples_on_a_daemon_thread_of_its_own_name_until_closed():
    """Started by default, it shows as `rekv-sharing` in thread dumps and logs, and never keeps
    the process from exiting."""
    seen, sampled = {}, threading.Event()

    def count():
        thread = threading.current_thread()
        seen.update(name=thread.name, daemon=thread.daemon)
        sampled.set()
        return 1

    meter = SharingMeter(count)
    try:
        assert sampled.wait(30.0), "the meter never sampled"
    finally:
        meter.close()
    assert seen == {"name": "rekv-sharing", "daemon": True}


def test_a_meter_sampled_by_its_caller_closes_without_a_thread():
    meter = SharingMeter(lambda: 2, start=False)
    meter.close()
    assert meter.average(0.0, 1.0) == 2.0


def test_a_failed_count_is_logged_by_name_and_sampling_goes_on(caplog):
    """One bad read of the count is reported as the meter's, with its traceback, and the
    thread keeps sampling."""
    calls, again = [], threading.Event()

    def count():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("no count")
        again.set()
        return 1

    with caplog.at_level("ERROR", logger="rekv_core.plan.sharing"):
        meter = SharingMeter(count)
        try:
            assert again.wait(30.0), "the meter stopped sampling after a failed count"
        finally:
            meter.close()
    failed = [r for r in caplog.records if r.exc_info]
    assert [r.getMessage() for r in failed] == ["sharing meter: counting failed"]
    assert "no count" in caplog.text


def test_closing_does_not_wait_for_a_count_that_never_returns():
    """A count stuck forever (a lock held elsewhere) does not hold `close()`: the thread is a
    daemon and close gives up on it."""
    stuck, entered = threading.Event(), threading.Event()

    def count():
        entered.set()
        stuck.wait()
        return 0

    meter = SharingMeter(count)
    closer = threading.Thread(target=meter.close, daemon=True)
    try:
        assert entered.wait(30.0)
        closer.start()
        closer.join(30.0)  # a close still waiting after this long waits for the stuck count
        assert not closer.is_alive()
    finally:
        stuck.set()
