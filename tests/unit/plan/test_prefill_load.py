"""The prefill worker's load book (`rekv_core.plan.prefill_load`), without a server: its own
compute queue, and the decode-side compute of its decisions that a stale offer missed (kept up to
and including `grace_s` after the handoff ended, one second by default, on the monotonic clock
unless told the time, and dropped without a trace)."""

import threading
import time

from rekv_core.plan.prefill_load import AssignedWork, Once, PrefillBacklog


def test_the_prefill_counts_its_decisions_a_stale_offer_missed():
    work = AssignedWork(grace_s=1.0)
    work.add("decode-1:5000", "a", 300.0)
    work.add("decode-1:5000", "b", 50.0)
    work.add("decode-2:5000", "c", 700.0)  # another decode worker's: never this one's wait
    assert work.unseen("decode-1:5000", planned=()) == 350.0
    work.ended("a", at=100.0)
    assert work.unseen("decode-1:5000", planned=(), now=100.5) == 350.0  # an offer made before
    assert work.unseen("decode-1:5000", planned=(), now=101.5) == 50.0  # forgotten after grace
    # once an offer names a handoff, the decode worker counts it: dropped here for good
    assert work.unseen("decode-1:5000", planned=frozenset({"b"})) == 0.0
    assert work.unseen("decode-1:5000", planned=()) == 0.0
    work.ended("unknown", at=100.0)  # a call that failed before its decision
    assert work.unseen("decode-2:5000", planned=(), now=200.0) == 700.0


def test_by_default_an_ended_handoff_counts_for_one_second_up_to_the_last_instant():
    work = AssignedWork()
    work.add("decode-1:5000", "a", 300.0)
    work.ended("a", at=100.0)
    assert work.unseen("decode-1:5000", planned=(), now=101.0) == 300.0  # exactly the grace
    assert work.unseen("decode-1:5000", planned=(), now=101.5) == 0.0


def test_without_times_given_the_monotonic_clock_decides():
    work = AssignedWork(grace_s=30.0)  # far wider than the gap between two calls, even loaded
    work.add("decode-1:5000", "old", 300.0)
    work.add("decode-1:5000", "new", 50.0)
    work.ended("old", at=time.monotonic() - 60.0)
    work.ended("new")  # now
    assert work.unseen("decode-1:5000", planned=()) == 50.0
    assert work.unseen("decode-1:5000", planned=(), now=time.monotonic() + 60.0) == 0.0


def test_a_handoff_both_named_and_past_its_grace_is_dropped_once():
    work = AssignedWork(grace_s=1.0)
    work.add("decode-1:5000", "a", 300.0)
    work.add("decode-1:5000", "b", 50.0)
    work.ended("a", at=100.0)
    assert work.unseen("decode-1:5000", planned=frozenset({"a"}), now=200.0) == 50.0


def test_a_forgotten_handoff_leaves_nothing_behind():
    """A later decision under an id that was dropped counts in full until it is named or ends."""
    work = AssignedWork(grace_s=1.0)
    work.add("decode-1:5000", "a", 300.0)
    work.ended("a", at=100.0)
    assert work.unseen("decode-1:5000", planned=(), now=102.0) == 0.0
    work.add("decode-1:5000", "a", 80.0)
    assert work.unseen("decode-1:5000", planned=(), now=103.0) == 80.0


def test_the_backlog_takes_each_handoff_out_exactly_once():
    backlog = PrefillBacklog()
    first, second = backlog.add(120.0), backlog.add(30.0)
    assert backlog.ms == 150.0
    first()
    first()  # the compute released and the call's cleanup both take it out: once
    assert backlog.ms == 30.0
    threads = [threading.Thread(target=second) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert backlog.ms == 0.0


def test_once_calls_its_function_a_single_time():
    calls = []
    once = Once(lambda: calls.append(1))
    once()
    once()
    assert calls == [1]
