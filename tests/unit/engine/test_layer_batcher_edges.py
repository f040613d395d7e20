"""The layer batcher at its edges: a lone run from a later layer, a turn with room for exactly one
more piece, a layer of more than two blocks, an allowance of one row, a lone run that fails; and
what it hands on (the invariant flag, a turn's context, each call's seconds)."""

from __future__ import annotations

import logging
import math
import threading
import time

import pytest
import torch

from rekv_core.engine import BatcherClosed, LayerBatcher
from rekv_core.engine import layer_batcher as layer_batcher_module
from rekv_core.model.blocks import EXEC_BLOCK
from rekv_core.model.layer_batch import layer_forward_batch
from tests.unit.engine.test_layer_batcher import (LAYERS, _counting, _equal, _Gate,
                                                  _hand_over_together, _inputs, _model,
                                                  _same_run)


def _flagging(flags: list[bool]):
    """The batched call, recording the invariant flag each call is given."""
    def forward(model, index, segments, invariant):
        flags.append(invariant)
        return layer_forward_batch(model, index, segments, invariant)
    return forward

def test_a_lone_run_from_a_later_layer_runs_its_own_layers_in_one_call():
    model, gate, calls, observed = _model(), _Gate(), [], []
    batcher = LayerBatcher(model, gate, forward=_counting(calls),
                           observer=lambda runs, rows, seconds: observed.append((runs, rows)))
    results, references = _hand_over_together(batcher, gate, model, [(32, 2, LAYERS, 0)])
    _same_run(results[0], references[0], _equal)
    assert calls == [] and observed == [(1, 32)]
    assert [spent for _, spent in gate.turns] == [32 * (LAYERS - 2)]


def test_room_for_exactly_one_more_layer_of_a_lone_run_is_used():
    """A run of one layer and one of four, 8 and 32 rows, in turns of 72 token-layers: the first
    turn's tick takes both at layer 0 (40), then the longer one alone has room for exactly one
    layer (32) and runs it; the next turn its last two (64)."""
    model, gate = _model(), _Gate(allowance=72)
    batcher = LayerBatcher(model, gate)
    results, references = _hand_over_together(batcher, gate, model,
                                              [(8, 0, 1, 0), (32, 0, LAYERS, 0)])
    for got, want in zip(results, references):
        _same_run(got, want, _equal)
    assert [spent for _, spent in gate.turns] == [72, 64]


def test_room_for_exactly_one_more_tick_is_used():
    """Three runs of 32 rows in turns of 192: two whole ticks (96 each) in every turn."""
    model, gate = _model(), _Gate(allowance=192)
    batcher = LayerBatcher(model, gate)
    _hand_over_together(batcher, gate, model, [(32, 0, LAYERS, 0)] * 3)
    assert [spent for _, spent in gate.turns] == [192] * (LAYERS // 2)


def test_a_layer_of_three_blocks_goes_block_by_block_and_leaves_whole():
    rows = 2 * EXEC_BLOCK + 88
    model, gate = _model(), _Gate(allowance=10)
    batcher = LayerBatcher(model, gate)
    results, references = _hand_over_together(batcher, gate, model, [(rows, LAYERS - 1, LAYERS, 0)])
    _same_run(results[0], references[0], _equal)
    assert [spent for _, spent in gate.turns] == [EXEC_BLOCK, EXEC_BLOCK, 88]


def test_an_allowance_of_one_row_runs_one_row_a_turn():
    """Two one-row runs in turns of one token-layer: each turn runs the oldest's row alone (its
    smallest piece), never the other's beside it."""
    model, gate = _model(), _Gate(allowance=1)
    batcher = LayerBatcher(model, gate)
    results, references = _hand_over_together(batcher, gate, model, [(1, 0, LAYERS, 0)] * 2)
    for got, want in zip(results, references):
        _same_run(got, want, _equal)
    assert [spent for _, spent in gate.turns] == [1] * (2 * LAYERS)


def test_the_invariant_flag_reaches_every_call():
    model, gate, flags = _model(), _Gate(), []

    batcher = LayerBatcher(model, gate, invariant=True, forward=_flagging(flags))
    _hand_over_together(batcher, gate, model, [(8, 0, LAYERS, 0)] * 2)
    assert flags and all(flag is True for flag in flags)


def test_a_turn_asked_of_the_batcher_is_its_turns_at_that_context():
    contexts = []

    class Recording(_Gate):
        def turn(self, context: int = 0):
            contexts.append(context)
            return super().turn(context)

    gate = Recording()
    gate.open.set()
    batcher = LayerBatcher(_model(), gate)
    try:
        with batcher.turn(7):
            pass
        with batcher.turn():
            pass
    finally:
        batcher.close()
    assert contexts == [7, 0]


def test_a_lone_run_of_one_block_in_turns_of_one_block_goes_a_whole_layer_a_turn():
    model, gate, calls = _model(), _Gate(allowance=EXEC_BLOCK), []
    batcher = LayerBatcher(model, gate, forward=_counting(calls))
    results, references = _hand_over_together(batcher, gate, model, [(EXEC_BLOCK, 0, LAYERS, 0)])
    _same_run(results[0], references[0], _equal)
    assert calls == []  # through `run_layers_chunk`, a layer at a time
    assert [spent for _, spent in gate.turns] == [EXEC_BLOCK] * LAYERS


def test_a_lone_run_reports_each_calls_seconds_and_their_sum_as_its_compute():
    """16 rows in turns of 32 token-layers: two calls of two layers."""
    model, gate, seconds = _model(), _Gate(allowance=32), []
    batcher = LayerBatcher(model, gate, observer=lambda runs, rows, took: seconds.append(took))
    h, cache = _inputs(model, 16, 0, 0, LAYERS, 0)
    gate.open.set()
    began = time.perf_counter()
    try:
        run = batcher.run_layers(model, h, 0, LAYERS, 0, cache)
    finally:
        batcher.close()
    elapsed = time.perf_counter() - began
    assert len(seconds) == 2 and all(isinstance(took, float) and took > 0.0 for took in seconds)
    assert sum(seconds) <= elapsed and math.isclose(run.compute_s, sum(seconds))


def test_a_failing_lone_call_raises_its_error_is_logged_and_the_batcher_serves_on(monkeypatch,
                                                                                   caplog):
    model, gate = _model(), _Gate()
    gate.open.set()
    batcher = LayerBatcher(model, gate)
    real = layer_batcher_module.run_layers_chunk

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    h, cache = _inputs(model, 8, 0, 1, LAYERS, 0)
    try:
        monkeypatch.setattr(layer_batcher_module, "run_layers_chunk", boom)
        with caplog.at_level(logging.ERROR, logger="rekv.engine.layers"):
            with pytest.raises(RuntimeError, match="boom"):
                batcher.run_layers(model, h, 1, LAYERS, 0, cache)
        assert [r.getMessage() for r in caplog.records] == [
            f"layers [1, {LAYERS}) of one run failed"]
        assert [spent for _, spent in gate.turns] == [8 * (LAYERS - 1)]  # spent, though failed
        monkeypatch.setattr(layer_batcher_module, "run_layers_chunk", real)
        assert batcher.run_layers(model, h, 1, LAYERS, 0, cache).h.shape == h.shape
    finally:
        batcher.close()


def test_by_default_runs_share_gemms_catch_up_may_be_zero_and_the_thread_is_a_named_daemon():
    model, gate, flags = _model(), _Gate(), []

    batcher = LayerBatcher(model, gate, forward=_flagging(flags), catch_up=0)
    thread = batcher._thread
    assert thread.name == "rekv-layers" and thread.daemon and thread in threading.enumerate()
    _hand_over_together(batcher, gate, model, [(8, 0, LAYERS, 0)] * 2)
    assert flags and not any(flags)
    assert not thread.is_alive()  # close() ended it


def test_a_run_of_no_rows_or_no_layers_is_its_input_at_once():
    model = _model()
    batcher = LayerBatcher(model, _Gate())  # a shut gate: anything handed over would wait
    h, cache = _inputs(model, 8, 0, 0, LAYERS, 0)
    try:
        for rows, start, stop in ((8, 2, 2), (0, 0, LAYERS)):
            run = batcher.run_layers(model, h[:rows], start, stop, 0, cache)
            assert run.h is not None and torch.equal(run.h, h[:rows]) and run.compute_s == 0.0
        assert batcher.pending == 0
    finally:
        batcher.close()


def test_the_refusals_say_what_happened():
    model = _model()
    batcher = LayerBatcher(model, _Gate())
    h, cache = _inputs(model, 8, 0, 0, LAYERS, 0)
    with pytest.raises(ValueError, match="^model: the batcher runs its own model's layers only$"):
        batcher.run_layers(_model(), h, 0, LAYERS, 0, cache)
    batcher.close()
    with pytest.raises(BatcherClosed, match="^the layer batcher is closed$"):
        batcher.run_layers(model, h, 0, LAYERS, 0, cache)

