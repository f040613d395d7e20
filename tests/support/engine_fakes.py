"""Builders and fakes for the engine's tests: a tiny random model, a fake clock, fake decode steps
(gated, failing, costed on the fake clock), a stream's recorder and an observer that records.

`Recorder` is a stream's `emit`: it keeps the tokens, the finish and the error, and sets `done`
when the stream ends (a finish or an error) and `reached(n)` events as tokens arrive, so a test
waits on events, never on sleeps. `GatedStep` runs one step each time the test opens the gate and
tells the test which batch it entered with, so a test can act between two steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from rekv_core.engine import ItlBudget, Stream
from rekv_core.model import KVCache, Model, ModelShape
from rekv_core.model.weights import synthetic_weights

WAIT_S = 60.0  # an event that does not arrive in this long is a hang, not slowness


def tiny_model(family: str = "llama", layers: int = 3, seed: int = 0) -> Model:
    """Random float32 weights of a small shape of `family` (its bias or QK norm included)."""
    shape = ModelShape(name=f"tiny-{family}", family=family, num_layers=layers, hidden_size=64,
                       num_heads=4, num_kv_heads=2, head_dim=16, ffn_size=96, vocab_size=97,
                       rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=True,
                       max_positions=4096)
    return Model(synthetic_weights(shape, torch.float32, seed=seed))


def empty_cache(model: Model, capacity: int = 64) -> KVCache:
    s = model.shape
    return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, capacity, model.dtype)


def budget(budget_ms: float = 30.0, idle_step_ms: float = 10.0,
           token_layer_ms: float = 0.01) -> ItlBudget:
    return ItlBudget(budget_ms, idle_step_ms, token_layer_ms)


def wait(event: threading.Event, what: str) -> None:
    assert event.wait(WAIT_S), f"timed out waiting for {what}"


class Recorder:
    """A stream's emit callback: what it was told, and events to wait on."""

    def __init__(self):
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._marks: dict[int, threading.Event] = {}

    def __call__(self, token: int | None, finish: str | None,
                 error: BaseException | None) -> None:
        with self._lock:
            if token is not None:
                self.tokens.append(token)
            self.finish, self.error = finish, error
            for n, event in self._marks.items():
                if len(self.tokens) >= n:
                    event.set()
        if finish is not None or error is not None:
            self.done.set()

    def reached(self, n: int) -> threading.Event:
        """An event set once `n` tokens have arrived."""
        with self._lock:
            event = self._marks.setdefault(n, threading.Event())
            if len(self.tokens) >= n:
                event.set()
        return event


def stream(name: str, cache, token: int, remaining: int, sampler: Callable | None = None,
           eos: int | None = None) -> tuple[Stream, Recorder]:
    recorder = Recorder()
    return Stream(request_id=name, cache=cache, token=token, remaining=remaining,
                  sampler=sampler or (lambda row: int(torch.argmax(row))), emit=recorder,
                  eos_token_id=eos), recorder


def next_token_logits(tokens: Sequence[int], vocab: int) -> torch.Tensor:
    """Logits `[B, vocab]` whose argmax is each fed token + 1 (mod vocab)."""
    logits = torch.zeros(len(tokens), vocab)
    for row, token in enumerate(tokens):
        logits[row, (int(token) + 1) % vocab] = 1.0
    return logits


class GatedStep:
    """A decode step that waits for the test to open the gate once per step; `entered[i]` is set
    when step i (from 0) has begun, and `batches[i]` holds the request ids it ran. `fail_at`: the
    step of that index raises `RuntimeError('boom')` once let through."""

    def __init__(self, vocab: int = 97, fail_at: int | None = None):
        self.vocab, self.fail_at = vocab, fail_at
        self.gate = threading.Semaphore(0)
        self.free = threading.Event()  # set: every later step runs without waiting
        self.batches: list[list[int]] = []  # id() of each cache of each step
        self._entered: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def entered(self, index: int) -> threading.Event:
        with self._lock:
            return self._entered.setdefault(index, threading.Event())

    def open(self, steps: int = 1) -> None:
        self.gate.release(steps)

    def open_all(self) -> None:
        self.free.set()
        self.gate.release()

    def __call__(self, model, tokens: Sequence[int], caches: Sequence) -> torch.Tensor:
        with self._lock:
            index = len(self.batches)
            self.batches.append([id(c) for c in caches])
        self.entered(index).set()
        if not self.free.is_set():
            assert self.gate.acquire(timeout=WAIT_S), "the test never opened the gate"
        if index == self.fail_at:
            raise RuntimeError("boom")
        return next_token_logits(tokens, self.vocab)


class FakeClock:
    """Seconds that move only when told to (thread-safe)."""

    def __init__(self):
        self._now = 1000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


class CostedStep:
    """A decode step that costs `fixed_ms + per_stream_ms × B` on the fake clock."""

    def __init__(self, clock: FakeClock, fixed_ms: float, per_stream_ms: float, vocab: int = 97):
        self.clock, self.fixed_ms, self.per_stream_ms, self.vocab = (clock, fixed_ms,
                                                                     per_stream_ms, vocab)

    def cost_ms(self, batch: int) -> float:
        return self.fixed_ms + self.per_stream_ms * batch

    def __call__(self, model, tokens: Sequence[int], caches: Sequence) -> torch.Tensor:
        self.clock.advance(self.cost_ms(len(tokens)) / 1e3)
        return next_token_logits(tokens, self.vocab)


class Observed:
    """An `EngineObserver` that records every step, token gap and turn."""

    def __init__(self):
        self.steps: list[tuple[int, float]] = []
        self.gaps: list[float] = []
        self.turns: list[tuple[int, float, int]] = []
        self._lock = threading.Lock()

    def stepped(self, batch: int, seconds: float) -> None:
        with self._lock:
            self.steps.append((batch, seconds))

    def token_gap(self, seconds: float) -> None:
        with self._lock:
            self.gaps.append(seconds)

    def turned(self, token_layers: int, seconds: float, batch: int) -> None:
        with self._lock:
            self.turns.append((token_layers, seconds, batch))
