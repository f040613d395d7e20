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


def test_between_several_sizes_the_step_follows_the_two_nearest_and_the_largest_two_beyond():
    """With sizes 1, 4, 8 and 16 seen, a batch of 6 lies on the line through 4 and 8, and one of
    20 on the line through 8 and 16 (the largest two), not through the smallest sizes."""
    b = ItlBudget(100.0, 10.0, 0.1)
    for batch, ms in ((4, 16.0), (8, 20.0), (16, 40.0)):
        b.observe_step(batch, ms)
    assert b.step_ms(6) == pytest.approx(18.0)
    assert b.step_ms(20) == pytest.approx(50.0)


def test_a_piece_moves_the_scale_by_its_measured_over_modelled_cost():
    """Each piece moves the scale by `EWMA` of the way to its measured over modelled cost, the
    model being base + per_key × context per token-layer (no context given: no keys)."""
    b = ItlBudget(100.0, 10.0, 0.1, per_key_ms=0.1)
    assert b.cost_ms() == pytest.approx(0.1)  # no context given: no keys attended
    assert b.cost_ms(10) == pytest.approx(1.1)
    b.observe_piece(1000, 200.0)  # no context: modelled 100 ms, measured twice that
    assert b.token_layer_ms == pytest.approx(0.1 * 1.2)
    b.observe_piece(1000, 200.0, context=0)
    assert b.token_layer_ms == pytest.approx(0.1 * (0.8 * 1.2 + 0.2 * 2))
    b.observe_piece(1000, 2200.0, context=10)  # modelled 1000 × 1.1 ms: twice again
    assert b.token_layer_ms == pytest.approx(0.1 * (0.8 * 1.36 + 0.2 * 2))
    assert b.cost_ms(10) == pytest.approx(1.1 * 1.488)


def test_a_piece_without_work_or_without_measured_time_leaves_the_scale():
    """A turn that computed nothing, or whose time measured nothing, says nothing of the cost;
    the smallest piece and the shortest time that do are observed."""
    b = ItlBudget(100.0, 10.0, 0.1)
    b.observe_piece(0, 5.0)
    b.observe_piece(100, 0.0)
    assert b.token_layer_ms == 0.1
    b.observe_piece(1, 0.2)  # one token-layer in a fifth of a millisecond: twice the model
    assert b.token_layer_ms == pytest.approx(0.12)
    b.observe_piece(10, 0.5)  # ten in half a millisecond: half the model
    assert b.token_layer_ms == pytest.approx(0.1 * (0.8 * 1.2 + 0.2 * 0.5))


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


EOS = 0


def _until(done: threading.Event):
    """A sampler that produces tokens until `done` is set, then the end of sequence: a stream
    that runs as long as the prefill work does, however the threads are scheduled."""
    return lambda row: EOS if done.is_set() else 1


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
        recorders, done = [], threading.Event()
        for i in range(streams):
            s, recorder = stream(f"s{i}", empty_cache(tiny_model(), 512), 1, 10**9,
                                 _until(done), EOS)
            engine.join(s)
            recorders.append(recorder)
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
    assert all(r.finish == "eos" for r in recorders)


def test_a_batch_whose_step_takes_the_budget_still_lets_the_work_progress():
    """A step alone over the budget: each turn runs its smallest piece, and the work ends."""
    clock, observed = FakeClock(), Observed()
    step = CostedStep(clock, fixed_ms=50.0, per_stream_ms=0.0)
    engine = DecodeEngine(tiny_model(), 4, ItlBudget(40.0, 50.0, PIECE_MS), observed, step,
                          clock).start()
    try:
        done = threading.Event()
        s, recorder = stream("s", empty_cache(tiny_model(), 512), 1, 10**9, _until(done), EOS)
        engine.join(s)
        _prefill_work(engine, clock, 5 * MIN_PIECE, done).start()
        wait(done, "the prefill work")
        wait(recorder.done, "the stream")
    finally:
        engine.close()
    assert recorder.finish == "eos"
    assert all(spent == MIN_PIECE for spent, _, _ in observed.turns)
    assert len(observed.turns) == 5
    assert torch.isfinite(torch.tensor(observed.gaps)).all()


class _TurnsSeen(Observed):
    """`Observed`, with an event set once the engine has reported a turn."""

    def __init__(self):
        super().__init__()
        self.turn_reported = threading.Event()

    def turned(self, token_layers: int, seconds: float, batch: int) -> None:
        super().turned(token_layers, seconds, batch)
        self.turn_reported.set()


def test_a_turn_is_allowed_at_its_rows_context_and_its_piece_is_learned_at_that_context():
    """With no stream running, a turn asking with a context of 1000 keys is allowed `SAFETY` of
    the whole budget at the cost of a token-layer over 1000 keys; its 100 token-layers taking
    twice the modelled time on the fake clock move the scale by `EWMA` of the way to 2, the
    observer is told the piece, its time and the batch, and the engine is idle again after."""
    clock, observed = FakeClock(), _TurnsSeen()
    budget = ItlBudget(100.0, 10.0, 0.1, per_key_ms=0.0001)  # 0.2 ms a token-layer at 1000 keys
    engine = DecodeEngine(tiny_model(), 4, budget, observed, CostedStep(clock, 10.0, 0.0),
                          clock).start()
    try:
        with engine.turn(context=1000) as turn:
            assert turn.allowance == int(SAFETY * 100.0 / 0.2)
            clock.advance(100 * 0.4 / 1e3)
            turn.spent = 100
        wait(observed.turn_reported, "the turn's report")
        assert budget.token_layer_ms == pytest.approx(0.1 * 1.2, rel=1e-6)
        (spent, seconds, batch), = observed.turns
        assert (spent, batch) == (100, 0) and seconds == pytest.approx(0.04, rel=1e-6)
        assert engine.idle()
    finally:
        engine.close()


class _JoiningStep(CostedStep):
    """A costed step that, while no stream waits, has a one-token stream join during the step:
    it waits to join when the turn of the same loop iteration is granted."""

    def __init__(self, clock: FakeClock):
        super().__init__(clock, fixed_ms=10.0, per_stream_ms=2.0)
        self.engine: DecodeEngine | None = None

    def __call__(self, model, tokens, caches):
        if self.engine.waiting() == 0:
            self.engine.join(stream("late", empty_cache(model, 64), 1, 1)[0])
        return super().__call__(model, tokens, caches)


@pytest.mark.parametrize("max_batch, batch", [(4, 2), (1, 1)])
def test_a_turn_counts_the_streams_that_will_join_the_next_step_up_to_the_batch_limit(
        max_batch, batch):
    """One stream runs and another waits to join when the turn is granted: the turn is allowed
    what fits beside the next step's batch, the running stream and the waiting one as far as
    `max_batch` lets it in (4: both; 1: the running one alone)."""
    clock, observed = FakeClock(), _TurnsSeen()
    budget = ItlBudget(100.0, 10.0, 0.1)
    step = _JoiningStep(clock)
    engine = DecodeEngine(tiny_model(), max_batch, budget, observed, step, clock)
    step.engine = engine
    running, _ = stream("running", empty_cache(tiny_model(), 512), 1, 1_000_000)
    engine.join(running)
    engine.start()
    try:
        with engine.turn() as turn:
            assert turn.allowance == budget.allowance(batch)
            turn.spent = 0
        wait(observed.turn_reported, "the turn's report")
        assert observed.turns[0][2] == batch
    finally:
        engine.close()
