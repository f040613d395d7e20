"""The prefill worker's scheduler: many prompts, one batched forward per tick, layers out as done.

`PrefillScheduler(model, token_budget)` runs a thread ("rekv-prefill"). `submit(token_ids,
through, deadline)` queues a prompt whose layers [0, through) are to be computed and returns its
`ScheduledPrefill`, whose `events()` yields, in layer order, a `LayerDone` for each layer once
every row of it is computed (the rows entering and leaving it, its K and V: layer c − 1's
`hidden_out` is the boundary h_c) and then a `Finished` (the rows leaving layer through − 1, what
the head is computed from). Its `compute_s` is its share of the compute so far: each batched call's
time split among its prompts by their rows. Each tick the thread:

1. drops the prompts whose consumer cancelled them, and ends those past their deadline with a
   `TimeoutError` naming the prompt (raised from `events()`): a prompt never waits silently;
2. picks the rows to run (`prefill_tick.plan_tick`: at most `token_budget` rows, the oldest
   prompt at least one block, then the least work left first, pieces block-aligned; short late
   arrivals first run alone until they reach the others' layer, `catch_up` layers at most, so
   that prompts arriving a few milliseconds apart share their layers' GEMMs);
3. runs them, one `layer_forward_batch` per layer the picks are at (prompts admitted at different
   times are at different layers: each such group is one batched call), and hands each prompt the
   layers it completed.

A prompt's rows computed in pieces are those computed whole: in `invariant` mode each prompt's K,
V and hidden states are the lone prefill's bit for bit, whatever else shares its ticks; in the
shared mode (the default) they agree with it to the rounding of a GEMM over more rows
(`model.layer_batch`). A forward that raises ends every prompt of that tick with the error.
`observer(prompts, rows, seconds)`, when set, sees each batched call (the service's metrics).
`close()` ends the thread; prompts still queued end with `SchedulerClosed`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from rekv_core.engine.prefill_tick import Pick, Progress, plan_tick
from rekv_core.engine.tick_calls import Forward, run_picks
from rekv_core.model.cache import KVCache
from rekv_core.model.executor import embed, validate_token_ids
from rekv_core.model.layer import Model
from rekv_core.model.layer_batch import Segment, layer_forward_batch

log = logging.getLogger("rekv.prefill.scheduler")

DEFAULT_TOKEN_BUDGET = 2048  # rows per tick, as vLLM's max_num_batched_tokens on its CPU backend
# layers a short late arrival may run alone to reach the prompts ahead of it (`prefill_tick`,
# rule 0): a prompt waits at most this many ticks of at most one block each for later arrivals
DEFAULT_CATCH_UP = 8


class SchedulerClosed(RuntimeError):
    pass


@dataclass(frozen=True)
class LayerDone:
    index: int
    hidden_in: torch.Tensor  # [S, d]: the rows entering the layer
    keys: torch.Tensor  # [n_kv, S, d_h]
    values: torch.Tensor
    hidden_out: torch.Tensor  # [S, d]: the rows leaving it


@dataclass(frozen=True)
class Finished:
    hidden_out: torch.Tensor  # [S, d]: the rows leaving layer through − 1


class ScheduledPrefill:
    """One prompt in the scheduler: what it computed so far, and its consumer's view."""

    def __init__(self, name: str, model: Model, token_ids: torch.Tensor, through: int,
                 deadline: float | None, seq: int):
        self.name, self.deadline = name, deadline
        shape, rows = model.shape, int(token_ids.numel())
        self.progress = Progress(seq=seq, rows=rows, through=through)
        self.cache = KVCache(max(through, 1), shape.num_kv_heads, shape.head_dim, rows,
                             model.dtype, model.device)
        self.hidden = embed(model, token_ids)  # entering the current layer
        self._next: list[torch.Tensor] = []  # rows of the current layer's output, in order
        self._events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.ended = False
        self.compute_s = 0.0

    def events(self) -> Iterator[LayerDone | Finished]:
        """The layers in order, then `Finished`; raises the error that ended the prompt."""
        while True:
            item = self._events.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Finished):
                return

    def cancel(self) -> None:
        """The consumer wants no more of it: the scheduler drops it at its next tick."""
        self.cancelled.set()

    def computed(self, pick: Pick, rows_out: torch.Tensor) -> None:
        self._next.append(rows_out)
        if not self.progress.advance(pick.r1 - pick.r0):
            return
        index, rows = pick.layer, self.progress.rows
        keys, values = self.cache.layer(index, rows)
        hidden_in = self.hidden
        self.hidden = self._next[0] if len(self._next) == 1 else torch.cat(self._next)
        self._next = []
        self._events.put(LayerDone(index, hidden_in, keys, values, self.hidden))
        if self.progress.done:
            self._end(Finished(self.hidden))

    def segment(self, pick: Pick) -> Segment:
        return Segment(self.hidden[pick.r0:pick.r1], pick.r0, self.cache)

    def fail(self, error: BaseException) -> None:
        self._end(error)

    def _end(self, item) -> None:
        if not self.ended:
            self.ended = True
            self._events.put(item)


class PrefillScheduler:
    def __init__(self, model: Model, token_budget: int = DEFAULT_TOKEN_BUDGET,
                 invariant: bool = False, catch_up: int = DEFAULT_CATCH_UP,
                 clock: Callable[[], float] = time.monotonic,
                 forward: Forward = layer_forward_batch,
                 observer: Callable[[int, int, float], None] | None = None):
        if token_budget < 1:
            raise ValueError(f"token_budget: must be at least 1, got {token_budget}")
        if catch_up < 0:
            raise ValueError(f"catch_up: must be >= 0 layers, got {catch_up}")
        self.model, self.token_budget, self.invariant = model, token_budget, invariant
        self.catch_up = catch_up
        self._clock, self._forward = clock, forward
        self.observer = observer  # (prompts, rows, seconds) of each batched call
        self._seq = itertools.count()
        self._waiting: list[ScheduledPrefill] = []
        self._active: list[ScheduledPrefill] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rekv-prefill", daemon=True)
        self._thread.start()

    def submit(self, token_ids: Sequence[int] | torch.Tensor, through: int,
               deadline: float | None = None, name: str = "") -> ScheduledPrefill:
        """Queue a prompt for layers [0, through); `deadline` on the scheduler's clock."""
        ids = validate_token_ids(token_ids, self.model.shape.vocab_size)
        if not 0 < through <= self.model.shape.num_layers:
            raise ValueError(f"through: must lie in [1, {self.model.shape.num_layers}], got "
                             f"{through}")
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the prefill scheduler is closed")
            seq = next(self._seq)
            job = ScheduledPrefill(name or f"prompt {seq}", self.model, ids, through, deadline,
                                   seq)
            self._waiting.append(job)
            self._cond.notify()
        return job

    @property
    def queued(self) -> int:
        """Prompts submitted and not yet finished."""
        with self._cond:
            return len(self._waiting) + len(self._active)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _admit(self) -> bool:
        """Moves submitted prompts in and drops the cancelled and the late; False once closed."""
        with self._cond:
            while not self._closed and not self._waiting and not self._active:
                self._cond.wait()
            if self._closed:
                for job in self._waiting + self._active:
                    job.fail(SchedulerClosed(f"{job.name}: the prefill scheduler closed"))
                self._waiting, self._active = [], []
                return False
            self._active += self._waiting
            self._waiting = []
        now = self._clock()
        for job in self._active:
            if job.cancelled.is_set():
                job.fail(SchedulerClosed(f"{job.name}: cancelled"))
            elif job.deadline is not None and now >= job.deadline:
                job.fail(TimeoutError(f"{job.name}: past its deadline after layer "
                                      f"{job.progress.layer} of {job.progress.through}"))
        with self._cond:
            self._active = [job for job in self._active if not job.ended]
        return True

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while self._admit():
            by_progress = {id(job.progress): job for job in self._active}
            picks = plan_tick([job.progress for job in self._active], self.token_budget,
                              self.catch_up)
            run_picks(self.model, picks, by_progress, self._forward, self.invariant,
                      self.observer)
            with self._cond:
                self._active = [job for job in self._active if not job.ended]
