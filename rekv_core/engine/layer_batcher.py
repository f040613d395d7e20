"""The decode worker's prefill-like runs of many requests, batched into shared layer calls.

A decode worker computes layers of prompts as well as decode steps: a handoff's suffix from its
boundary, a token-only prompt, a failed handoff's recompute (`model.turns`). Run each on its own
thread, as separate turns of the decode engine, eight short handoffs at once compute one after
the other, each reading every weight on its own. `LayerBatcher(model, turns)` runs them together
instead, as the prefill worker's scheduler does (`prefill_scheduler`): it is `LayerTurns` over the
engine's turns (or `UNLIMITED`); `run_layers(model, h, start, stop, pos, cache)` hands a run of
rows [pos, pos + n) through layers [start, stop) to its thread ("rekv-layers") and waits for it.

The thread takes one turn of `turns` at a time, at the runs' mean context, and within its
allowance (token-layers) runs ticks: each tick picks rows by `prefill_tick.plan_tick` (the oldest
run at least one block, then the least work left first, late arrivals catching up `catch_up`
layers) and runs one `layer_forward_batch` per layer the picks are at. A tick after the turn's
first runs only if it fits what is left of the allowance; so a turn overruns its allowance only by
its first tick, which is at most one block of the oldest run where the allowance is smaller
(the smallest piece, as `model.turns` runs: work always progresses). A run alone with its current
layer whole runs through as many layers as the allowance holds in one `run_layers_chunk`, as
`run_layers_in_turns` would.

Each run's K and V land in its own cache and its rows leave bit-identical to one unchunked
`run_layers_chunk` when it runs alone or with `invariant`; sharing GEMMs with other runs, they
agree to the rounding of a GEMM over more rows (`model.layer_batch`). A call that raises ends every
run of it with the error, raised from `run_layers`; `close()` ends the runs still waiting with
`BatcherClosed`. `turn(context)` passes through to `turns` (a speculative draft's turns).
`observer(runs, rows, seconds)`, when set, sees each call (a lone run's several layers are one
call); `pending` counts the runs handed over and not yet out (the service's metrics).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rekv_core.engine.prefill_scheduler import DEFAULT_CATCH_UP
from rekv_core.engine.prefill_tick import Pick, Progress, plan_tick
from rekv_core.engine.tick_calls import Forward, run_picks
from rekv_core.model.blocks import EXEC_BLOCK
from rekv_core.model.cache import KVCache
from rekv_core.model.executor import check_layer_run, run_layers_chunk
from rekv_core.model.layer import Model
from rekv_core.model.layer_batch import Segment, layer_forward_batch
from rekv_core.model.turns import UNLIMITED, ComputeTurns, LayerRun, Turn

log = logging.getLogger("rekv.engine.layers")


class BatcherClosed(RuntimeError):
    pass


@dataclass(eq=False)
class _Run:
    progress: Progress  # its layer: absolute, from start to stop
    h: torch.Tensor  # the rows entering the current layer
    pos: int
    cache: KVCache
    parts: list[torch.Tensor] = field(default_factory=list)  # the current layer's rows out
    compute_s: float = 0.0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def context(self) -> int:
        """The keys its rows attend to on average."""
        return self.pos + self.progress.rows // 2

    def segment(self, pick: Pick) -> Segment:
        return Segment(self.h[pick.r0:pick.r1], self.pos + pick.r0, self.cache)

    def computed(self, pick: Pick, out: torch.Tensor) -> None:
        self.parts.append(out)
        if self.progress.advance(pick.r1 - pick.r0):
            self.h = self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)
            self.parts = []
            if self.progress.done:
                self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


class LayerBatcher:
    def __init__(self, model: Model, turns: ComputeTurns = UNLIMITED, invariant: bool = False,
                 catch_up: int = DEFAULT_CATCH_UP, forward: Forward = layer_forward_batch,
                 observer: Callable[[int, int, float], None] | None = None):
        if catch_up < 0:
            raise ValueError(f"catch_up: must be >= 0 layers, got {catch_up}")
        self.model, self.turns, self.invariant, self.catch_up = model, turns, invariant, catch_up
        self._forward = forward
        self.observer = observer  # (runs, rows, seconds) of each call (the service's metrics)
        self._seq = itertools.count()
        self._runs: list[_Run] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rekv-layers", daemon=True)
        self._thread.start()

    def turn(self, context: int = 0) -> contextlib.AbstractContextManager[Turn]:
        return self.turns.turn(context)

    def run_layers(self, model: Model, h: torch.Tensor, start: int, stop: int, pos: int,
                   cache: KVCache) -> LayerRun:
        """Rows [pos, pos + n) of `h` `[n, d]` through layers [start, stop), their K and V written
        into `cache`; waits until they are out, or raises what ended them."""
        if model is not self.model:
            raise ValueError("model: the batcher runs its own model's layers only")
        n = h.shape[0]
        check_layer_run(model, n, start, stop, pos, cache)
        if n == 0 or start == stop:
            return LayerRun(h, 0.0)
        with self._cond:
            if self._closed:
                raise BatcherClosed("the layer batcher is closed")
            run = _Run(Progress(next(self._seq), n, stop, layer=start), h, pos, cache)
            self._runs.append(run)
            self._cond.notify()
        run.done.wait()
        if run.error is not None:
            raise run.error
        return LayerRun(run.h, run.compute_s)

    @property
    def pending(self) -> int:
        """Runs handed over and not yet out."""
        with self._cond:
            return len(self._runs)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    # -- the thread --

    def _active(self, block: bool) -> list[_Run]:
        """The runs not yet out (waiting for one when `block`); empty once closed."""
        with self._cond:
            self._runs = [run for run in self._runs if not run.done.is_set()]
            while block and not self._closed and not self._runs:
                self._cond.wait()
            if self._closed:
                for run in self._runs:
                    run.fail(BatcherClosed("the layer batcher closed"))
                self._runs = []
            return list(self._runs)

    @torch.inference_mode()
    def _loop(self) -> None:
        while runs := self._active(block=True):
            context = sum(run.context for run in runs) // len(runs)
            try:
                with self.turns.turn(context) as turn:
                    turn.spent = self._turn(max(1, turn.allowance))
            except Exception as exc:  # the turn itself failed: no run waits on it forever
                log.exception("a turn of %d layer run(s) failed", len(runs))
                for run in self._active(block=False):
                    run.fail(exc)

    def _turn(self, allowance: int) -> int:
        """Ticks within `allowance` token-layers (the first one whatever it costs) over the runs
        handed over by each tick's start; spent."""
        spent = 0
        while runs := self._active(block=False):
            room = allowance - spent
            if len(runs) == 1 and runs[0].progress.row == 0:
                cost = self._alone(runs[0], room, first=spent == 0)
            else:
                cost = self._tick(runs, room, first=spent == 0)
            if not cost:
                break
            spent += cost
            if spent >= allowance:
                break
        return spent

    def _alone(self, run: _Run, room: int, first: bool) -> int:
        """A lone run at a layer's first row: whole layers in one call; token-layers spent."""
        p = run.progress
        if p.rows > room and not first:
            return 0
        if p.rows > max(room, EXEC_BLOCK):
            return self._tick([run], room, first)
        layers = max(1, min(p.through - p.layer, room // p.rows))
        began = time.perf_counter()
        try:
            out = run_layers_chunk(self.model, run.h, p.layer, run.pos, run.cache,
                                   p.layer + layers)
            self._settle()
        except Exception as exc:
            log.exception("layers [%d, %d) of one run failed", p.layer, p.layer + layers)
            run.fail(exc)
            return p.rows * layers
        took = time.perf_counter() - began
        run.compute_s += took
        if self.observer is not None:
            self.observer(1, p.rows, took)
        p.layer += layers - 1  # `computed` completes the last one
        run.computed(Pick(p, p.layer, 0, p.rows), out)
        return p.rows * layers

    def _tick(self, runs: list[_Run], room: int, first: bool) -> int:
        """One tick of `plan_tick` over `runs`, unless it overruns `room` after the first."""
        by_progress = {id(run.progress): run for run in runs}
        picks = plan_tick([run.progress for run in runs], max(1, room), self.catch_up)
        rows = sum(pick.r1 - pick.r0 for pick in picks)
        if not picks or (rows > room and not first):
            return 0
        run_picks(self.model, picks, by_progress, self._forward, self.invariant,
                  self.observer, self._settle)
        return rows

    def _settle(self) -> None:
        """On CUDA, the call's kernels ended: its time is the device's, not the launches'."""
        if self.model.device.type == "cuda":
            torch.cuda.current_stream(self.model.device).synchronize()

