"""One loop per decode worker that owns the model: continuous batching with budgeted prefill turns.

`DecodeEngine(model, max_batch, budget)` runs a thread ("rekv-engine"). A request whose cache is
ready (its handoff received, or recomputed) `join`s it as a `Stream`: the cache, the token to feed
next (the first token, sampled from the handoff's logits by the caller, who has already sent it),
the tokens still to produce, its own sampler and its `emit(token, finish)` callback. Each
iteration of the loop:

1. takes the cancelled streams out (their caches are let go at once) and lets waiting streams
   join, up to `max_batch` running (more wait, in arrival order);
2. runs one batched decode step for every running stream (`engine_step`: one forward, each
   stream's attention over its own cache; on a GPU one CUDA graph replay), samples each stream's next token
   with its own sampler (so a seeded stream draws the same tokens whatever company it keeps) and
   emits it; a stream that reached EOS (when it stops there) or its last token leaves;
3. grants one waiting turn of prefill-like work (`turns.turn()`, `model.turns`), with an allowance
   of what fits the ITL budget beside the batch (`budget.ItlBudget.allowance`), and waits for it
   to end; with no stream running, turns follow each other directly.

A stream therefore waits, between two tokens, for one batched step and at most one turn. The
engine learns step and piece costs from what it runs (`ItlBudget.observe_*`), and reports each
step, each inter-token gap and each turn to its `EngineObserver` (the service's metrics). A step
that raises ends every stream of that batch with the error (`emit(None, None, error)`): never a
silent drop; so does an error of the loop itself, for every stream. `close()` ends the loop;
streams still running end with `EngineClosed`, and turns asked for afterwards are granted at
once, unbounded. `clock` and `step` are injectable, so a test can run the loop against a fake
clock and a fake step cost.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rekv_core.engine.budget import ItlBudget
from rekv_core.model.batched import batched_decode_step
from rekv_core.model.blocks import linear as block_linear
from rekv_core.model.bucketed import BucketedDecoder
from rekv_core.model.cache import KVCache
from rekv_core.model.layer import Model
from rekv_core.model.packed import PackedLinears
from rekv_core.model.turns import Turn

log = logging.getLogger("rekv.engine")

UNBOUNDED = 1 << 62
Step = Callable[[Model, Sequence[int], Sequence[KVCache]], torch.Tensor]


@dataclass(frozen=True)
class EngineState:
    """What the engine's offer tells a planner: the streams running and waiting to join, the ITL
    budget, and the learned costs of a step of that batch and of one token-layer of prefill work."""

    running: int
    waiting: int
    itl_budget_ms: float
    step_ms: float
    token_layer_ms: float


class EngineClosed(RuntimeError):
    """The engine stopped before the stream finished."""


class EngineObserver(Protocol):
    def stepped(self, batch: int, seconds: float) -> None: ...
    def token_gap(self, seconds: float) -> None: ...
    def turned(self, token_layers: int, seconds: float, batch: int) -> None: ...


class _Quiet:
    def stepped(self, batch: int, seconds: float) -> None:
        pass

    def token_gap(self, seconds: float) -> None:
        pass

    def turned(self, token_layers: int, seconds: float, batch: int) -> None:
        pass


@dataclass(eq=False)
class Stream:
    request_id: str
    cache: KVCache
    token: int  # the token to feed next: the last one emitted
    remaining: int  # tokens still to produce
    sampler: Callable[[torch.Tensor], int]
    emit: Callable[[int | None, str | None, BaseException | None], None]  # token, finish, error
    eos_token_id: int | None = None  # stop there, when set
    last_token_at: float = 0.0  # the engine's clock at the last emitted token
    cancelled: bool = field(default=False, init=False)


@dataclass(eq=False)
class _Ticket:
    context: int = 0  # the keys the piece's rows attend to on average
    turn: Turn = field(default_factory=lambda: Turn(allowance=0))
    granted: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)


def _emit(stream: Stream, token: int | None, finish: str | None,
          error: BaseException | None) -> None:
    try:
        stream.emit(token, finish, error)
    except Exception:  # a caller gone (its loop closed) must not stop the others' tokens
        log.exception("stream %s: emit failed; the stream is taken out", stream.request_id)
        stream.cancelled = True


def engine_step(model: Model, max_batch: int = 32, capacity: int | None = None,
                invariant: bool = False) -> Step:
    """The batched step for this model. On CUDA, `bucketed.BucketedDecoder`: the batch's caches in
    one slab of `max_batch` slots of `capacity` positions (default: the model's context), one CUDA
    graph per batch bucket. On the CPU, `batched_decode_step` with one GEMM per weight over the
    batch, with prepacked weights (`model.packed`) where PyTorch can pack them (float32).

    A GEMM over B rows rounds differently from one over a row, which in BF16 is enough to flip a
    greedy near-tie within a few dozen tokens. So with `invariant` (the services'
    `--batch-invariant`) each row runs through the single-stream step's kernels (`exact_linear`),
    on either device and in any dtype: every stream's tokens are then the single-process
    reference's whatever the batch, at the cost of reading the weights once per row. Without it
    (the default) a stream's logits agree with the reference's to the rounding of the larger GEMM;
    what a lossless handoff promises (the cache the prefill computed, bit for bit) holds either
    way."""
    if model.device.type == "cuda":
        return BucketedDecoder(model, max_batch, capacity or model.shape.max_positions,
                               linear=exact_linear if invariant else block_linear)
    if invariant:
        return functools.partial(batched_decode_step, linear=exact_linear)
    packed = PackedLinears.for_model(model)
    if packed is None:
        return batched_decode_step
    return functools.partial(batched_decode_step, linear=packed.linear)


def exact_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """`blocks.linear` one row at a time: each row's result is the single-stream step's."""
    return torch.cat([block_linear(x[i:i + 1], weight, bias) for i in range(x.shape[0])])


def prepare_engine_thread(model: Model) -> None:
    """On the CPU in float32 (the GEMM-batched step), the calling thread's float math treats
    subnormals as zero (FTZ/DAZ are per thread: the turns' prefill work, on other threads, is
    untouched). SiLU's tail makes subnormals, which cost a batched CPU step up to a fifth of its
    time (32 streams: 235 → 194 ms); a logit moves by less than 1e-30."""
    if model.device.type == "cpu" and model.dtype == torch.float32:
        torch.set_flush_denormal(True)


class DecodeEngine:
    def __init__(self, model: Model, max_batch: int, budget: ItlBudget,
                 observer: EngineObserver | None = None, step: Step = batched_decode_step,
                 clock: Callable[[], float] = time.perf_counter):
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        self.model, self.max_batch, self.budget = model, max_batch, budget
        self.observer = observer or _Quiet()
        self._step, self._clock = step, clock
        self._cond = threading.Condition()
        self._joining: collections.deque[Stream] = collections.deque()
        self._running: list[Stream] = []
        self._tickets: collections.deque[_Ticket] = collections.deque()
        self._closed = False
        self._turning = False
        self._thread = threading.Thread(target=self._run, name="rekv-engine", daemon=True)

    def start(self) -> DecodeEngine:
        self._thread.start()
        return self

    # -- what the rest of the worker calls (any thread) --

    def now(self) -> float:
        return self._clock()

    def join(self, stream: Stream) -> None:
        if stream.remaining < 1:
            raise ValueError(f"remaining: a stream joins with tokens to produce, got "
                             f"{stream.remaining}")
        with self._cond:
            if self._closed:
                raise EngineClosed("decode engine: closed")
            if not stream.last_token_at:
                stream.last_token_at = self._clock()
            self._joining.append(stream)
            self._cond.notify_all()

    def cancel(self, stream: Stream) -> None:
        """Take the stream out: at once where it waits to join, else before the next step."""
        with self._cond:
            stream.cancelled = True
            if stream in self._joining:
                self._joining.remove(stream)
            self._cond.notify_all()

    def running(self) -> int:
        with self._cond:
            return len(self._running)

    def waiting(self) -> int:
        with self._cond:
            return len(self._joining)

    def state(self) -> EngineState:
        with self._cond:
            running, waiting = len(self._running), len(self._joining)
        batch = min(self.max_batch, running + waiting)
        return EngineState(running, waiting, self.budget.budget_ms, self.budget.step_ms(batch),
                           self.budget.token_layer_ms)

    def idle(self) -> bool:
        with self._cond:
            return not (self._running or self._joining or self._tickets or self._turning)

    @contextlib.contextmanager
    def turn(self, context: int = 0) -> Iterator[Turn]:
        """A turn of prefill-like work (`model.turns.ComputeTurns`): waits until granted."""
        ticket = _Ticket(context)
        with self._cond:
            if self._closed:
                ticket.turn.allowance = UNBOUNDED
                ticket.granted.set()
            else:
                self._tickets.append(ticket)
                self._cond.notify_all()
        ticket.granted.wait()
        try:
            yield ticket.turn
        finally:
            ticket.released.set()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        self._end_all(EngineClosed("decode engine: closed"))

    def _end_all(self, error: BaseException) -> None:
        """Every stream still here ends with `error`; every turn asked for is granted, unbounded."""
        with self._cond:
            self._closed = True
            ended = list(self._joining) + self._running
            self._joining.clear()
            self._running = []
            tickets = list(self._tickets)
            self._tickets.clear()
        for stream in ended:
            _emit(stream, None, None, error)
        for ticket in tickets:
            ticket.turn.allowance = UNBOUNDED
            ticket.granted.set()

    # -- the loop --

    def _run(self) -> None:
        prepare_engine_thread(self.model)
        try:
            self._loop()
        except BaseException as exc:  # a broken loop ends every stream with its error, never hangs
            log.exception("decode engine: the loop failed; ending every stream")
            self._end_all(exc)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (self._joining or self._running
                                                or self._tickets):
                    self._cond.wait()
                if self._closed:
                    return
                self._running = [s for s in self._running if not s.cancelled]
                while self._joining and len(self._running) < self.max_batch:
                    self._running.append(self._joining.popleft())
                batch = list(self._running)
                ticket = self._tickets.popleft() if self._tickets else None
                self._turning = ticket is not None
            if batch:
                self._decode(batch)
            if ticket is not None:
                self._grant(ticket)
            batch = ticket = None  # nothing of a stream that left is held while the loop waits

    def _decode(self, batch: list[Stream]) -> None:
        began = self._clock()
        try:
            logits = self._step(self.model, [s.token for s in batch], [s.cache for s in batch])
        except Exception as exc:  # every stream of the batch ends with it: none is dropped
            log.exception("decode step of %d streams failed", len(batch))
            self._leave(batch, batch)
            for stream in batch:
                _emit(stream, None, None, exc)
            return
        took = self._clock() - began
        self.budget.observe_step(len(batch), took * 1e3)
        self.observer.stepped(len(batch), took)
        finished = []
        for stream, row in zip(batch, logits):
            if stream.cancelled:
                finished.append(stream)
                continue
            try:
                token = stream.sampler(row)
            except Exception as exc:  # this stream's own sampling: it alone ends with the error
                log.exception("stream %s: sampling failed", stream.request_id)
                finished.append(stream)
                _emit(stream, None, None, exc)
                continue
            now = self._clock()
            self.observer.token_gap(now - stream.last_token_at)
            stream.last_token_at, stream.token = now, token
            stream.remaining -= 1
            finish = ("eos" if stream.eos_token_id is not None and token == stream.eos_token_id
                      else "length" if stream.remaining <= 0 else None)
            if finish is not None:
                finished.append(stream)
            _emit(stream, token, finish, None)
        if finished:
            self._leave(batch, finished)

    def _leave(self, batch: list[Stream], leaving: list[Stream]) -> None:
        gone = {id(s) for s in leaving}
        with self._cond:
            self._running = [s for s in self._running if id(s) not in gone]

    def _grant(self, ticket: _Ticket) -> None:
        with self._cond:
            batch = len(self._running) + min(len(self._joining),
                                             self.max_batch - len(self._running))
        ticket.turn.allowance = self.budget.allowance(batch, ticket.context)
        began = self._clock()
        ticket.granted.set()
        ticket.released.wait()
        took = self._clock() - began
        with self._cond:
            self._turning = False
        self.budget.observe_piece(ticket.turn.spent, took * 1e3, ticket.context)
        self.observer.turned(ticket.turn.spent, took, batch)
