"""The ITL budget: its arithmetic (`ItlBudget`), and the engine keeping it on a fake clock.

The engine runs with a decode step that costs a fixed time per step and per stream on a fake
clock (`CostedStep`), while a thread does prefill-like work through `engine.turn()`, each piece
advancing the same clock by its token-layers at a fixed cost. No wall-clock time is asserted: every
gap a stream sees is measured on the fake clock.
"""

from __future__ import annotations

import threading

import pytest
import torch

from rekv_core.engine import DecodeEngine, ItlBudget
from rekv_core.engine.budget import SAFETY
from tests.support.engine_fakes import CostedStep, FakeClock, Observed, empty_cache, stream, \
    tiny_model, wait

PIECE_MS = 0.01  # what one token-layer of the fake prefill work costs on the fake clock
MIN_PIECE = 256  # its smallest piece, as one block of rows through one layer


def test_the_step_of_an_unseen_batch_is_interpolated_and_extrapolated():
    b = ItlBudget(100.0, 10.0, 0.1)
    assert b.step_ms(0) == 0.0 and b.step_ms(1) == 10.0
    assert b.step_ms(4) == 40.0  # one size known: at most in proportion
    b.observe_step(8, 30.0)
    assert b.step_ms(4) == pytest.approx(10.0 + 20.0 * 3 / 7)
    assert b.step_ms(16) == pytest.approx(30.0 + 20.0 * 8 / 7)


def test_the_allowance_is_the_spare_time_at_the_cost_of_the_rows_context():
    b = ItlBudget(100.0, 20.0, 0.1, per_key_ms=0.0001)
    assert b.allowance(1) == int(SAFETY * 80.0 / 0.1)
    assert b.allowance(1, context=1000) == int(SAFETY * 80.0 / 0.2)
    assert b.allowance(10) == 0  # the step alone takes the budget: the smallest piece runs
    b.observe_piece(1000, 200.0)  # twice the model: the scale follows
    assert 0.1 < b.token_layer_ms < 0.2
    with pytest.raises(ValueError, match="budget_ms"):
        ItlBudget(0.0, 10.0, 0.1)
    with pytest.raises(ValueError, match="per_key_ms"):
        ItlBudget(10.0, 10.0, 0.1, per_key_ms=-1.0)


def _prefill_work(engine: DecodeEngine, clock: FakeClock, token_layers: int,
                  done: threading.Event) -> threading.Thread:
    def run() -> None:
        left = token_layers
        while left > 0:
            with engine.turn() as turn:
                piece = min(left, max(turn.allowance, MIN_PIECE))
                clock.advance(piece * PIECE_MS / 1e3)
                turn.spent = piece
            left -= piece
        done.set()

    return threading.Thread(target=run, daemon=True)


@pytest.mark.parametrize("streams", [1, 3])
def test_running_streams_keep_the_budget_while_prefill_work_runs(streams):
    """Every gap between two tokens of every stream stays within the budget while 60,000
    token-layers of prefill work (600 ms of compute on the fake clock) go through the turns,
    and the work finishes."""
    clock, observed = FakeClock(), Observed()
    step = CostedStep(clock, fixed_ms=10.0, per_stream_ms=2.0)
    budget = ItlBudget(40.0, idle_step_ms=12.0, token_layer_ms=PIECE_MS)
    engine = DecodeEngine(tiny_model(), 8, budget, observed, step, clock).start()
    try:
        recorders = []
        for i in range(streams):
            s, recorder = stream(f"s{i}", empty_cache(tiny_model(), 512), 1, 400)
            engine.join(s)
            recorders.append(recorder)
        done = threading.Event()
        worker = _prefill_work(engine, clock, 60_000, done)
        worker.start()
        wait(done, "the prefill work")
        for recorder in recorders:
            wait(recorder.done, "the streams")
    finally:
        engine.close()
    assert sum(spent for spent, _, _ in observed.turns) == 60_000
    assert len(observed.turns) > 10  # it was cut into many turns between steps
    assert max(observed.gaps) * 1e3 <= budget.budget_ms + 1e-6
    assert all(r.finish == "length" for r in recorders)


def test_a_batch_whose_step_takes_the_budget_still_lets_the_work_progress():
    """A step alone over the budget: each turn runs its smallest piece, and the work ends."""
    clock, observed = FakeClock(), Observed()
    step = CostedStep(clock, fixed_ms=50.0, per_stream_ms=0.0)
    engine = DecodeEngine(tiny_model(), 4, ItlBudget(40.0, 50.0, PIECE_MS), observed, step,
                          clock).start()
    try:
        s, recorder = stream("s", empty_cache(tiny_model(), 512), 1, 300)
        engine.join(s)
        done = threading.Event()
        _prefill_work(engine, clock, 5 * MIN_PIECE, done).start()
        wait(done, "the prefill work")
    finally:
        engine.close()
    assert all(spent == MIN_PIECE for spent, _, _ in observed.turns)
    assert len(observed.turns) == 5
    assert torch.isfinite(torch.tensor(observed.gaps)).all()
