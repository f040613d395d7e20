"""A stream's life in the engine outside the happy path: cancelled (running or waiting), finished
as the engine goes idle, ended by a failing step or sampler, ended by `close()`; and the engine's
own checks. The decode step is a gated fake (`fakes.GatedStep`: the test lets each step through),
so each test acts between two known steps; a cache's release is seen by a `weakref.finalize`
event, not by polling.
"""

from __future__ import annotations

import threading
import weakref

import pytest

from rekv_core.engine import DecodeEngine, EngineClosed
from rekv_core.engine.loop import UNBOUNDED
from tests.support.engine_fakes import GatedStep, budget, empty_cache, stream, tiny_model, wait

MODEL = tiny_model(layers=1)


def _released(cache) -> threading.Event:
    """An event set when `cache` is garbage: nothing holds it any more."""
    event = threading.Event()
    weakref.finalize(cache, event.set)
    return event


def _engine(step, max_batch: int = 4) -> DecodeEngine:
    return DecodeEngine(MODEL, max_batch, budget(), step=step)


def _finish(engine: DecodeEngine, step: GatedStep) -> None:
    step.open_all()
    engine.close()


def test_a_cancelled_running_stream_leaves_and_its_cache_is_let_go_before_the_next_step():
    """b is cancelled while a step of a, b, c runs: it gets no token from that step, its cache is
    garbage before the next step begins, that step runs a and c only, and they go on producing
    their tokens."""
    step = GatedStep()
    engine = _engine(step)
    made = {name: stream(name, empty_cache(MODEL), 10 * i, 50) for i, name in enumerate("abc")}
    b_released = _released(made["b"][0].cache)
    ids = {name: id(s.cache) for name, (s, _) in made.items()}
    for s, _ in made.values():
        engine.join(s)
    engine.start()
    try:
        wait(step.entered(0), "the first step")
        engine.cancel(made["b"][0])
        b_recorder = made.pop("b")[1]
        step.open()
        wait(step.entered(1), "the second step")
        assert b_released.is_set(), "the cancelled stream's cache is still held"
        assert step.batches[1] == [ids["a"], ids["c"]] and engine.running() == 2
        step.open(2)
        wait(step.entered(3), "the fourth step")
        assert b_recorder.tokens == [] and not b_recorder.done.is_set()
        assert made["a"][1].tokens == [1, 2, 3] and made["c"][1].tokens == [21, 22, 23]
    finally:
        _finish(engine, step)


def test_a_cancelled_waiting_stream_is_let_go_at_once():
    """With the batch full, a waiting stream that is cancelled leaves the queue at once (waiting()
    drops to 0, its cache is garbage before any further step) and never runs."""
    step = GatedStep()
    engine = _engine(step, max_batch=1)
    a, _ = stream("a", empty_cache(MODEL), 0, 50)
    b, b_recorder = stream("b", empty_cache(MODEL), 0, 50)
    b_released = _released(b.cache)
    engine.join(a)
    engine.join(b)
    engine.start()
    try:
        wait(step.entered(0), "the first step")
        assert engine.waiting() == 1
        engine.cancel(b)
        del b
        assert engine.waiting() == 0 and b_released.is_set()
        step.open()
        wait(step.entered(1), "the second step")
        assert len(step.batches[1]) == 1 and b_recorder.tokens == []
    finally:
        _finish(engine, step)


@pytest.mark.parametrize("how", ["finished", "cancelled"])
def test_the_last_stream_s_cache_is_let_go_when_the_engine_goes_idle(how):
    """The only stream leaves (its last token, or cancelled during its step) and the engine has
    nothing else to do: the engine keeps no reference to it while idle, so its cache is garbage."""
    step = GatedStep()
    engine = _engine(step)
    a, recorder = stream("a", empty_cache(MODEL), 0, 2)
    released = _released(a.cache)
    engine.join(a)
    engine.start()
    try:
        if how == "cancelled":
            wait(step.entered(0), "the first step")
            engine.cancel(a)
        del a
        step.open(2)
        if how == "finished":
            wait(recorder.done, "the stream to finish")
        assert released.wait(10), "the engine holds the last stream's cache while idle"
        assert engine.running() == 0
    finally:
        _finish(engine, step)


def test_a_failing_step_ends_every_stream_of_its_batch_with_the_error():
    """The second step of a and b raises: both end with that very error after their first token,
    none is left running; the stream waiting behind them (batch limit 2) then runs as usual."""
    step = GatedStep(fail_at=1)
    engine = _engine(step, max_batch=2)
    made = {name: stream(name, empty_cache(MODEL), 0, 5) for name in "ab"}
    made["w"] = stream("w", empty_cache(MODEL), 40, 2)
    for s, _ in made.values():
        engine.join(s)
    engine.start()
    try:
        step.open(4)
        for name in "abw":
            wait(made[name][1].done, f"stream {name} to end")
        a, b, w = (made[name][1] for name in "abw")
        assert isinstance(a.error, RuntimeError) and str(a.error) == "boom"
        assert b.error is a.error and a.tokens == [1] and b.tokens == [1]
        assert w.error is None and w.tokens == [41, 42] and w.finish == "length"
        assert engine.running() == 0
    finally:
        _finish(engine, step)


def test_a_failing_sampler_ends_its_stream_with_the_error_and_the_others_continue():
    """b's sampler raises on its second token: b ends with that error; a gets all its tokens and
    the engine goes on serving."""
    calls = []

    def sampler_failing_at_second(row):
        calls.append(row)
        if len(calls) == 2:
            raise ValueError("bad logits")
        return int(row.argmax())

    step = GatedStep()
    engine = _engine(step)
    a, a_recorder = stream("a", empty_cache(MODEL), 0, 4)
    b, b_recorder = stream("b", empty_cache(MODEL), 10, 4, sampler=sampler_failing_at_second)
    engine.join(a)
    engine.join(b)
    engine.start()
    try:
        step.open(10)
        wait(a_recorder.done, "a to finish")
        wait(b_recorder.done, "b to end")
        assert isinstance(b_recorder.error, ValueError) and b_recorder.tokens == [11]
        assert a_recorder.tokens == [1, 2, 3, 4] and a_recorder.finish == "length"
        assert engine.running() == 0
    finally:
        _finish(engine, step)


def _turn_in_thread(engine: DecodeEngine) -> tuple[threading.Thread, list[int]]:
    allowances: list[int] = []

    def take() -> None:
        with engine.turn() as turn:
            allowances.append(turn.allowance)
    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread, allowances


def test_close_ends_running_and_waiting_streams_and_grants_every_turn():
    """close() while a runs and b waits: both end once, with EngineClosed (b with no token); a turn
    asked for before close is granted (by the loop or by close), one asked for after is granted at
    once, unbounded; joining a closed engine raises EngineClosed; a second close is harmless."""
    step = GatedStep()
    engine = _engine(step, max_batch=1)
    a, a_recorder = stream("a", empty_cache(MODEL), 0, 10**9)
    b, b_recorder = stream("b", empty_cache(MODEL), 0, 10**9)
    engine.join(a)
    engine.join(b)
    engine.start()
    wait(step.entered(0), "the first step")
    before, before_allowances = _turn_in_thread(engine)
    closing = threading.Thread(target=engine.close, daemon=True)
    closing.start()
    step.open_all()
    closing.join(60)
    before.join(60)
    assert not closing.is_alive() and not before.is_alive() and len(before_allowances) == 1
    assert isinstance(a_recorder.error, EngineClosed) and isinstance(b_recorder.error,
                                                                     EngineClosed)
    assert b_recorder.tokens == []
    with engine.turn() as turn:
        assert turn.allowance == UNBOUNDED
    with pytest.raises(EngineClosed):
        engine.join(stream("c", empty_cache(MODEL), 0, 1)[0])
    first_error = a_recorder.error
    engine.close()
    assert a_recorder.error is first_error and engine.running() == 0 and engine.waiting() == 0


def test_close_of_an_engine_never_started_ends_its_streams_and_grants_waiting_turns_unbounded():
    """An engine closed before its loop ran: the joined streams end with EngineClosed and a turn
    waiting for its grant gets one, unbounded."""
    engine = _engine(GatedStep())
    a, recorder = stream("a", empty_cache(MODEL), 0, 3)
    engine.join(a)
    waiting, allowances = _turn_in_thread(engine)
    engine.close()
    waiting.join(60)
    assert allowances == [UNBOUNDED]
    assert isinstance(recorder.error, EngineClosed) and recorder.tokens == []


def test_the_engine_checks_its_inputs():
    """A batch limit below 1 and a stream with nothing to produce are refused, naming the field."""
    with pytest.raises(ValueError, match="max_batch"):
        DecodeEngine(MODEL, 0, budget())
    engine = _engine(GatedStep())
    with pytest.raises(ValueError, match="remaining"):
        engine.join(stream("a", empty_cache(MODEL), 0, 0)[0])
    engine.close()


def test_the_engine_is_idle_only_with_no_stream_and_no_turn_waiting():
    """A stream waiting to join, or a turn asked for and not yet granted, each alone keeps the
    engine from being idle (the engine here not started, so neither moves on)."""
    joined = _engine(GatedStep())
    asked = _engine(GatedStep())
    try:
        assert joined.idle() and asked.idle()
        joined.join(stream("a", empty_cache(MODEL), 0, 10**9)[0])
        assert not joined.idle()
        thread, _ = _turn_in_thread(asked)
        seen = threading.Event()
        for _ in range(3000):  # the asking thread queues its ticket; 30 s at most
            if not asked.idle():
                seen.set()
                break
            seen.wait(0.01)
        assert seen.is_set(), "a turn asked for left the engine idle"
    finally:
        joined.close()
        asked.close()
    thread.join(30)
    assert not thread.is_alive()
