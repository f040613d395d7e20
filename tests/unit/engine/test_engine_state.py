"""What the engine tells a planner (`DecodeEngine.state`), the default ITL budget, the idle
measurement's median, and `exact_linear` (the batched step's row-at-a-time linear outside
float32): each against what its contract says, so that a changed line fails here."""

from __future__ import annotations

import pytest
import torch

from rekv_core.engine import ITL_BUDGET_FACTOR, DecodeEngine, default_budget_ms
from rekv_core.engine import budget as budget_module
from rekv_core.engine.loop import exact_linear
from rekv_core.model.blocks import linear as block_linear
from tests.support.engine_fakes import GatedStep, budget, empty_cache, stream, tiny_model, wait

MODEL = tiny_model(layers=1)


def _check_state(engine: DecodeEngine, running: int, waiting: int) -> None:
    state = engine.state()
    assert (state.running, state.waiting) == (running, waiting)
    batch = min(engine.max_batch, running + waiting)
    assert state.step_ms == engine.budget.step_ms(batch)
    assert state.itl_budget_ms == engine.budget.budget_ms
    assert state.token_layer_ms == engine.budget.token_layer_ms


def test_the_state_counts_running_and_waiting_streams_and_prices_the_batch_they_make():
    """Three streams, room for two: before the engine starts all three wait; during its first
    step two run and one waits. The step it reports is that of the batch the streams fill
    (min(max_batch, running + waiting)): 2 here, 20 ms from a 10 ms single-stream step, not 1 or
    3 streams' step."""
    step = GatedStep()
    engine = DecodeEngine(MODEL, 2, budget(budget_ms=30.0, idle_step_ms=10.0,
                                           token_layer_ms=0.25), step=step)
    for i in range(3):
        engine.join(stream(f"s{i}", empty_cache(MODEL), i, 50)[0])
    assert engine.budget.step_ms(1) != engine.budget.step_ms(2) != engine.budget.step_ms(3)
    _check_state(engine, running=0, waiting=3)
    engine.start()
    try:
        wait(step.entered(0), "the first step")
        _check_state(engine, running=2, waiting=1)
        state = engine.state()
        assert (state.step_ms, state.itl_budget_ms, state.token_layer_ms) == (20.0, 30.0, 0.25)
    finally:
        step.open_all()
        engine.close()


def test_an_idle_engine_reports_no_step():
    engine = DecodeEngine(MODEL, 4, budget(), step=GatedStep())
    state = engine.state()
    assert (state.running, state.waiting, state.step_ms) == (0, 0, 0.0)
    engine.close()


def test_the_default_budget_is_the_factor_times_the_idle_step():
    assert ITL_BUDGET_FACTOR > 1
    assert default_budget_ms(12.5) == ITL_BUDGET_FACTOR * 12.5


def test_the_idle_measurement_is_the_median_of_its_runs(monkeypatch):
    """`_median_ms` times `repeats` runs of the callable with `perf_counter` and returns the
    median in milliseconds: runs of 1 s, 5 s and 2 s give 2,000 ms."""
    ticks = iter([0.0, 1.0, 10.0, 15.0, 20.0, 22.0])
    monkeypatch.setattr(budget_module.time, "perf_counter", lambda: next(ticks))
    calls = []
    assert budget_module._median_ms(lambda: calls.append(1), repeats=3) == 2000.0
    assert len(calls) == 3
    with pytest.raises(StopIteration):  # it read the clock exactly twice a run
        next(ticks)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_exact_linear_is_the_single_row_linear_of_every_row(dtype, with_bias):
    """Each output row is bit for bit what `blocks.linear` gives that row alone (a GEMM over all
    rows may round differently in bfloat16). Five rows of four features, so that a loop over the
    wrong dimension loses a row."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4, generator=g).to(dtype)
    weight = torch.randn(6, 4, generator=g).to(dtype)
    bias = torch.randn(6, generator=g).to(dtype) if with_bias else None
    got = exact_linear(x, weight, bias)
    assert got.shape == (5, 6) and got.dtype == dtype
    for i in range(5):
        assert torch.equal(got[i:i + 1], block_linear(x[i:i + 1], weight, bias)), f"row {i}"
    if with_bias:
        assert not torch.equal(got, exact_linear(x, weight, None))
