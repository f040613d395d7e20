"""The decode worker's layer batcher: several requests' layer runs handed over at once share its
layer calls, each run's rows and K, V are its lone run's (bit for bit alone or invariant, to
float64 rounding shared), every turn keeps to its allowance but for one smallest piece, and a run
that fails or is closed raises, never hangs."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from rekv_core.engine import BatcherClosed, LayerBatcher
from rekv_core.model import KVCache, Model
from rekv_core.model.blocks import EXEC_BLOCK
from rekv_core.model.executor import embed, run_layers_chunk
from rekv_core.model.layer_batch import layer_forward_batch
from rekv_core.model.turns import UNLIMITED, TimedTurns, Turn, run_layers_in_turns
from rekv_core.model.weights import synthetic_weights
from tests.support.engine_fakes import WAIT_S, empty_cache, tiny_model

LAYERS = 4
# (rows, start, stop, pos): a token-only prompt, suffixes from two cuts, a second boundary chunk
RUNS = [(40, 0, LAYERS, 0), (7, 2, LAYERS, 0), (300, 1, LAYERS, 0), (20, 1, 3, EXEC_BLOCK)]


def _model(dtype: torch.dtype = torch.float32) -> Model:
    shape = tiny_model(layers=LAYERS).shape
    return Model(synthetic_weights(shape, dtype, seed=1))


def _inputs(model: Model, rows: int, pos: int, start: int, stop: int, seed: int):
    """The rows entering layer `start`, and a cache holding rows [0, pos) of layers
    [start, stop) (as an earlier chunk left them)."""
    gen = torch.Generator().manual_seed(seed)
    cache = empty_cache(model, pos + rows)
    if pos:
        run_layers_chunk(model, embed(model, torch.randint(0, 97, (pos,), generator=gen)),
                         start, 0, cache, stop)
    return embed(model, torch.randint(0, 97, (rows,), generator=gen)), cache


def _copy(cache: KVCache) -> KVCache:
    return KVCache.from_layers([k.clone() for k in cache.keys],
                               [v.clone() for v in cache.values], cache.capacity)


class _Gate:
    """Turns that wait for the test to open them, each granted `allowance`; records what every
    turn was allowed and spent."""

    def __init__(self, allowance: int = 1 << 62):
        self.allowance = allowance
        self.open = threading.Event()
        self.turns: list[tuple[int, int]] = []  # (allowance, spent)

    @contextlib.contextmanager
    def turn(self, context: int = 0) -> Iterator[Turn]:
        assert self.open.wait(WAIT_S), "the test never opened the gate"
        turn = Turn(self.allowance)
        yield turn
        self.turns.append((turn.allowance, turn.spent))


def _counting(calls: list[int]):
    def forward(model, index, segments, invariant):
        calls.append(len(segments))
        return layer_forward_batch(model, index, segments, invariant)
    return forward


def _wait_pending(batcher: LayerBatcher, runs: int) -> None:
    """Until `runs` runs are handed over (a hang fails after `WAIT_S`)."""
    deadline = time.monotonic() + WAIT_S
    while batcher.pending < runs:
        assert time.monotonic() < deadline, f"{batcher.pending} of {runs} runs handed over"
        threading.Event().wait(0.001)


def _hand_over_together(batcher: LayerBatcher, gate: _Gate, model: Model, runs):
    """Hand every run over on its own thread while the gate is shut, then open it, and close the
    batcher; each run's (h out, cache) and the reference's (its lone run on a copy of the same
    cache)."""
    results: list = [None] * len(runs)
    threads, references = [], []
    for i, (rows, start, stop, pos) in enumerate(runs):
        h, cache = _inputs(model, rows, pos, start, stop, seed=i)
        ref_cache = _copy(cache)
        references.append((run_layers_chunk(model, h, start, pos, ref_cache, stop), ref_cache))

        def go(i=i, h=h, cache=cache, start=start, stop=stop, pos=pos):
            results[i] = (batcher.run_layers(model, h, start, stop, pos, cache).h, cache)
        threads.append(threading.Thread(target=go, daemon=True))
        threads[-1].start()
    try:
        _wait_pending(batcher, len(runs))
        gate.open.set()
        for thread in threads:
            thread.join(WAIT_S)
            assert not thread.is_alive(), "a run never came back"
    finally:
        gate.open.set()
        batcher.close()
    return results, references


def _same_run(got, want, same):
    (h, cache), (ref_h, ref_cache) = got, want
    same(h, ref_h, "h out")
    for index in range(LAYERS):
        same(cache.keys[index], ref_cache.keys[index], f"K of layer {index}")
        same(cache.values[index], ref_cache.values[index], f"V of layer {index}")


def _equal(got, want, what):
    assert torch.equal(got, want), what


def _close(got, want, what):
    err = float((got - want).abs().max())
    assert err <= 1e-9 * max(1.0, float(want.abs().max())), f"{what}: off by {err:.3g}"


@pytest.mark.parametrize("allowance", [1 << 62, 500])
def test_invariant_runs_handed_over_together_are_each_their_lone_run(allowance):
    model, gate, calls = _model(), _Gate(allowance), []
    batcher = LayerBatcher(model, gate, invariant=True, forward=_counting(calls))
    results, references = _hand_over_together(batcher, gate, model, RUNS)
    for got, want in zip(results, references):
        _same_run(got, want, _equal)
    assert max(calls) > 1  # runs at one layer went into one call


def test_the_shared_mode_batches_the_runs_and_agrees_with_their_lone_runs_to_rounding():
    """The four runs reach each other's layers (the first catching up) and share calls: each
    run-layer in one call, fewer calls than run-layers, three runs in one call; each run agrees
    with its lone run to float64 rounding."""
    model, gate, calls, observed = _model(torch.float64), _Gate(), [], []
    batcher = LayerBatcher(model, gate, forward=_counting(calls),
                           observer=lambda runs, rows, seconds: observed.append((runs, rows)))
    results, references = _hand_over_together(batcher, gate, model, RUNS)
    for got, want in zip(results, references):
        _same_run(got, want, _close)
    assert [runs for runs, _ in observed] == calls  # the observer sees every call
    assert sum(rows for _, rows in observed) == sum(n * (stop - start)
                                                    for n, start, stop, _ in RUNS)
    assert sum(calls) == sum(stop - start for _, start, stop, _ in RUNS)
    assert len(calls) < sum(calls)
    assert max(calls) == 3


def test_every_turn_keeps_its_allowance_and_the_work_is_all_done():
    """Three runs of 32 rows, four layers each, in turns of 100 token-layers: each turn runs
    whole ticks that fit (three rows of 32: 96), and the turns add up to the 384 token-layers."""
    model, gate = _model(), _Gate(allowance=100)
    batcher = LayerBatcher(model, gate)
    _hand_over_together(batcher, gate, model, [(32, 0, LAYERS, 0)] * 3)
    assert all(spent <= allowance for allowance, spent in gate.turns)
    assert sum(spent for _, spent in gate.turns) == 3 * 32 * LAYERS
    assert [spent for _, spent in gate.turns] == [96] * LAYERS


def test_a_lone_run_goes_through_as_many_layers_as_the_allowance_holds():
    """32 rows alone in turns of 70 token-layers: two layers a turn (64), in one call each."""
    model, gate, calls, observed = _model(), _Gate(allowance=70), [], []
    batcher = LayerBatcher(model, gate, forward=_counting(calls),
                           observer=lambda runs, rows, seconds: observed.append((runs, rows)))
    results, references = _hand_over_together(batcher, gate, model, [(32, 0, LAYERS, 0)])
    _same_run(results[0], references[0], _equal)
    assert [spent for _, spent in gate.turns] == [64, 64]
    assert calls == []  # whole layers through `run_layers_chunk`, not the batched call
    assert observed == [(1, 32), (1, 32)]  # each of those calls seen once


def test_a_turn_smaller_than_one_block_still_runs_the_smallest_piece():
    """An allowance of 10 token-layers under a run of 300 rows: each turn runs one block of
    rows (or the rest) through one layer, and the run ends, its rows the lone run's."""
    model, gate = _model(), _Gate(allowance=10)
    batcher = LayerBatcher(model, gate)
    results, references = _hand_over_together(batcher, gate, model, [(300, 2, LAYERS, 0)])
    _same_run(results[0], references[0], _equal)
    assert [spent for _, spent in gate.turns] == [EXEC_BLOCK, 300 - EXEC_BLOCK] * 2


def test_a_failing_call_ends_its_runs_with_the_error_and_the_batcher_serves_on():
    model, gate, failing = _model(), _Gate(), [True]

    def forward(model, index, segments, invariant):
        if failing[0]:
            raise RuntimeError("boom")
        return layer_forward_batch(model, index, segments, invariant)

    batcher = LayerBatcher(model, gate, forward=forward)
    errors = []

    def go(seed):
        h, cache = _inputs(model, 8, 0, 0, LAYERS, seed)
        try:
            batcher.run_layers(model, h, 0, LAYERS, 0, cache)
        except RuntimeError as exc:
            errors.append(str(exc))

    try:
        threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        _wait_pending(batcher, 2)
        gate.open.set()
        for t in threads:
            t.join(WAIT_S)
        assert errors == ["boom", "boom"]
        failing[0] = False
        h, cache = _inputs(model, 8, 0, 0, LAYERS, 5)
        want = run_layers_chunk(model, h, 0, 0, _copy(cache), LAYERS)
        assert torch.equal(batcher.run_layers(model, h, 0, LAYERS, 0, cache).h, want)
    finally:
        batcher.close()


def test_a_run_waiting_when_the_batcher_closes_ends_with_batcher_closed():
    model, gate = _model(), _Gate()
    batcher = LayerBatcher(model, gate)
    outcome: list[BaseException] = []
    h, cache = _inputs(model, 8, 0, 0, LAYERS, 0)

    def go():
        try:
            batcher.run_layers(model, h, 0, LAYERS, 0, cache)
        except BatcherClosed as exc:
            outcome.append(exc)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    _wait_pending(batcher, 1)
    closing = threading.Thread(target=batcher.close, daemon=True)
    closing.start()
    while not batcher._closed:
        threading.Event().wait(0.001)
    gate.open.set()  # the thread's turn is granted after the close: it runs nothing
    closing.join(WAIT_S)
    thread.join(WAIT_S)
    assert len(outcome) == 1 and str(outcome[0]) == "the layer batcher closed"
    with pytest.raises(BatcherClosed):
        batcher.run_layers(model, h, 0, LAYERS, 0, cache)


def test_bad_runs_are_refused_with_the_field_named():
    model = _model()
    batcher = LayerBatcher(model)
    h, cache = _inputs(model, 8, 0, 0, LAYERS, 0)
    try:
        with pytest.raises(ValueError, match="pos"):
            batcher.run_layers(model, h, 0, LAYERS, 3, empty_cache(model, 64))
        with pytest.raises(ValueError, match="capacity"):
            batcher.run_layers(model, h, 0, LAYERS, 0, empty_cache(model, 4))
        with pytest.raises(ValueError, match="layers"):
            batcher.run_layers(model, h, 2, 1, 0, cache)
        with pytest.raises(ValueError, match="model"):
            batcher.run_layers(_model(), h, 0, LAYERS, 0, cache)
        with pytest.raises(ValueError, match="catch_up"):
            LayerBatcher(model, catch_up=-1)
    finally:
        batcher.close()


def test_timed_turns_hand_a_run_to_the_batcher_and_count_its_share_as_compute():
    """Through `TimedTurns` over the batcher, `run_layers_in_turns` is the batcher's run: the
    load book is told computing then not, and the compute grows by the run's share."""
    model = _model()
    batcher = LayerBatcher(model, UNLIMITED)
    told: list[bool] = []
    timed = TimedTurns(batcher, told.append)
    h, cache = _inputs(model, 16, 0, 0, LAYERS, 0)
    try:
        out = run_layers_in_turns(model, h, 0, LAYERS, 0, cache, timed)
    finally:
        batcher.close()
    assert torch.equal(out, run_layers_chunk(model, h, 0, 0, _copy(empty_cache(model, 16)),
                                             LAYERS))
    assert told == [True, False]
    assert timed.compute_s > 0.0
