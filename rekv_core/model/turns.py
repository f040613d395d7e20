"""Prefill-like work cut into turns, so a decode engine can interleave it with its decode steps.

A decode worker computes more than decode steps: the suffix from a boundary, a token-only
handoff's prefill, a failed handoff's recompute. Each of those runs here as a sequence of pieces,
each one a block of rows through a run of layers, and each piece asks `turns.turn()` for its turn
first: a context manager that waits until the turn is granted and yields a `Turn`, whose
`allowance` bounds the piece in token-layers (rows × layers), and which the piece tells what it
spent. `UNLIMITED` grants every turn at once with no bound (no engine: a test, a bench, the
prefill side); `rekv_core.engine` grants them between its decode steps, sized to its ITL budget.

`run_layers_in_turns(model, h, start, stop, pos, cache, turns)` is `run_layers_chunk` cut into
such pieces and `prefill_in_turns(model, ids, cache, turns, stop)` the prompt's prefill. A piece
covers whole `EXEC_BLOCK`s of rows (or the tail) through one or more whole layers, and runs
through `run_layers_chunk`, so the K, V and hidden states are bit-identical to one unchunked run
whatever the allowances were. The smallest piece (one block of rows, one layer) runs even when
the allowance is smaller: work always progresses. `TimedTurns` times a caller's turns and tells
its load book when it computes.

Turns that also offer `run_layers(model, h, start, stop, pos, cache) -> LayerRun` (`LayerTurns`:
the decode worker's `engine.LayerBatcher`) take the whole run instead: `run_layers_in_turns`
hands it over, so that the runs of several requests at the same layer share one batched call.
`LayerRun.compute_s` is the run's share of the compute that served it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rekv_core.model.blocks import EXEC_BLOCK
from rekv_core.model.cache import KVCache
from rekv_core.model.executor import embed, run_layers_chunk
from rekv_core.model.layer import Model, final_logits


@dataclass
class Turn:
    allowance: int  # token-layers this piece may compute (a piece of one block × one layer runs
    spent: int = 0  # regardless); what it computed, told by the piece


class ComputeTurns(Protocol):
    def turn(self, context: int = 0) -> contextlib.AbstractContextManager[Turn]:
        """`context`: the keys the piece's rows attend to on average, which its cost grows
        with."""


class _Unlimited:
    @contextlib.contextmanager
    def turn(self, context: int = 0) -> Iterator[Turn]:
        yield Turn(allowance=1 << 62)


UNLIMITED: ComputeTurns = _Unlimited()


@dataclass(frozen=True)
class LayerRun:
    h: torch.Tensor  # [n, d]: the rows leaving layer stop − 1
    compute_s: float  # this run's share of the compute that served it


class LayerTurns(ComputeTurns, Protocol):
    def run_layers(self, model: Model, h: torch.Tensor, start: int, stop: int, pos: int,
                   cache: KVCache) -> LayerRun:
        """`run_layers_chunk(model, h, start, pos, cache, stop)`, done by these turns."""


def piece(rows_left: int, layers_left: int, allowance: int) -> tuple[int, int]:
    """(rows, layers) of the next piece: all the rows through as many layers as the allowance
    holds, else as many whole blocks of rows as it holds through one layer; at least one block
    (or the tail) through one layer."""
    if rows_left <= 0 or layers_left <= 0:
        raise ValueError(f"piece: nothing left ({rows_left} rows, {layers_left} layers)")
    if rows_left <= EXEC_BLOCK or rows_left <= allowance:
        return rows_left, max(1, min(layers_left, allowance // rows_left))
    return min(rows_left, max(1, allowance // EXEC_BLOCK) * EXEC_BLOCK), 1


@torch.inference_mode()
def run_layers_in_turns(model: Model, h: torch.Tensor, start: int, stop: int, pos: int,
                        cache: KVCache, turns: ComputeTurns = UNLIMITED) -> torch.Tensor:
    """`run_layers_chunk(model, h, start, pos, cache, stop)` in pieces, each in its own turn (or
    handed whole to `turns.run_layers` where the turns offer it); the residual states leaving
    layer stop − 1, `[n, d]`."""
    run_layers = getattr(turns, "run_layers", None)
    if run_layers is not None:
        return run_layers(model, h, start, stop, pos, cache).h
    return _run_in_pieces(model, h, start, stop, pos, cache, turns)


def _run_in_pieces(model: Model, h: torch.Tensor, start: int, stop: int, pos: int,
                   cache: KVCache, turns: ComputeTurns) -> torch.Tensor:
    n = h.shape[0]
    outs: list[torch.Tensor] = []
    row = 0
    while row < n:  # a run of rows through every layer, in one or more pieces
        rows, layer, part = 0, start, h[row:]
        while layer < stop:
            # the keys the rows would attend to on average, if the piece took all that are left
            with turns.turn(pos + row + (n - row if not rows else rows) // 2) as turn:
                if not rows:
                    rows, layers = piece(n - row, stop - layer, turn.allowance)
                    part = part[:rows]
                else:
                    layers = max(1, min(stop - layer, turn.allowance // rows))
                part = run_layers_chunk(model, part, layer, pos + row, cache, layer + layers)
                turn.spent = rows * layers
            layer += layers
        if not rows:  # no layers to run
            return h
        outs.append(part)
        row += rows
    return outs[0] if len(outs) == 1 else torch.cat(outs)


@torch.inference_mode()
def prefill_in_turns(model: Model, token_ids: Sequence[int], cache: KVCache,
                     turns: ComputeTurns = UNLIMITED, stop: int | None = None
                     ) -> torch.Tensor:
    """The prompt through layers [0, stop) (all by default) in turns, its K and V written into
    `cache` from position 0 (its length set to the prompt's when every layer ran); returns the
    last position's logits `[vocab]` when every layer ran, else the states leaving layer
    stop − 1 `[S, d]`."""
    stop = model.shape.num_layers if stop is None else stop
    h = run_layers_in_turns(model, embed(model, token_ids), 0, stop, 0, cache, turns)
    if stop < model.shape.num_layers:
        return h
    cache.length = max(cache.length, h.shape[0])
    return final_logits(model, h[-1])


class TimedTurns:
    """`turns` whose every turn is timed (`compute_s`, on CUDA up to the device's end of the
    piece) and told to `computing(True/False)` (the decode side's load book): a caller's compute,
    without its waits for a turn. Over `LayerTurns`, a run is told as computing from its hand-over
    to its return, and `compute_s` grows by its share of the batched calls."""

    def __init__(self, turns: ComputeTurns, computing: Callable[[bool], None] | None = None,
                 device: torch.device | None = None):
        self.turns, self.computing = turns, computing
        self.cuda = device if device is not None and device.type == "cuda" else None
        self.compute_s = 0.0

    @contextlib.contextmanager
    def turn(self, context: int = 0) -> Iterator[Turn]:
        with self.turns.turn(context) as turn:
            began = time.perf_counter()
            if self.computing:
                self.computing(True)
            try:
                yield turn
                if self.cuda is not None:
                    torch.cuda.current_stream(self.cuda).synchronize()
            finally:
                if self.computing:
                    self.computing(False)
                self.compute_s += time.perf_counter() - began

    @torch.inference_mode()
    def run_layers(self, model: Model, h: torch.Tensor, start: int, stop: int, pos: int,
                   cache: KVCache) -> LayerRun:
        before = self.compute_s
        run_layers = getattr(self.turns, "run_layers", None)
        if run_layers is None:
            out = _run_in_pieces(model, h, start, stop, pos, cache, self)
            return LayerRun(out, self.compute_s - before)
        if self.computing:
            self.computing(True)
        try:
            run = run_layers(model, h, start, stop, pos, cache)
        finally:
            if self.computing:
                self.computing(False)
        self.compute_s += run.compute_s
        return run
