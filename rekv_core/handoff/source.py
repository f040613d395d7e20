"""What a handoff sends, as the prefill produces it.

A `PrefillSource` gives the sender the prompt's `token_ids` (what token-only sends), the prefix
layers' K and V in layer order (`layers()`), the boundary h_c (`boundary()`, for an interior cut:
once `layers()` has yielded layer c−1, which is when the prefill has computed it) and, for
transfer-only, the last position's final hidden state (`head()`, once `layers()` is exhausted).

- `FinishedPrefill(state, token_ids, cut)`: from a `PrefillOutput` that ran every layer (the
  seed's schedule: the handoff starts once the prefill is done, and the boundary goes first).

Both that and `LivePrefill` take `through` (default: the cut): `layers()` yields layers
[0, through), and `head()` is the final hidden state after layer through − 1 (a token split sends
layers past the cut too, `through` = L, and the head); and `input_rows` l (KVPR's per-layer form):
each yielded layer also carries its input rows [0, l) (`ProducedLayer.inputs`; a finished prefill
must have kept h_i for every layer it yields).
- `LivePrefill(model, token_ids, cut)`: runs the prefill one layer at a time as the sender asks for
  the next one, so layer i is encoded and on the wire while layer i+1 computes, and stops at the
  cut: layers c..L−1 are the decode side's (partial prefill; token-only computes nothing). With
  `importance_window` each layer also carries its tokens' importance (for `spectrum`). Its
  compute runs on the caller's current stream; a sender that encodes on a stream of its own waits
  for that stream per layer. `on_done` is called once, when the last layer is computed (before
  it is yielded: the prefill service releases its compute lock at the cut, not once the sender
  has sent it) or the source is closed, whichever is first, and `compute_s` is the compute's
  time.
- `ChunkedPrefill(model, token_ids, cut, chunk_tokens)` (pipelined, token order): runs layers
  [0, c) one token chunk at a time (`run_layers_chunk`, the chunks `chunk_bounds` gives; each
  attends to the earlier chunks' K and V, so every row is the unchunked prefill's, bit for bit),
  and `chunks()` yields each chunk once it has reached the cut: its h_c rows and its rows of every
  prefix layer. Only an interior cut. `on_done` and `compute_s` as for `LivePrefill`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rekv_core.model.blocks import chunk_bounds
from rekv_core.model.cache import KVCache
from rekv_core.model.executor import Model, PrefillOutput, embed, iter_layers, run_layers_chunk


@dataclass(frozen=True)
class ProducedLayer:
    index: int
    keys: torch.Tensor  # [n_kv, S, d_h]
    values: torch.Tensor
    importance: torch.Tensor | None = None  # [S], for codecs that rank tokens
    inputs: torch.Tensor | None = None  # [l, d]: the layer's input rows [0, l) (per-layer form)


@dataclass(frozen=True)
class ProducedChunk:
    index: int
    rows: tuple[int, int]  # [s0, s1)
    boundary: torch.Tensor  # h_c's rows [n, d]
    layers: list[ProducedLayer]  # each prefix layer's K and V of these rows [n_kv, n, d_h]


class PrefillSource(Protocol):
    streamed: bool
    pipelined: bool
    device: torch.device
    token_ids: Sequence[int]
    cut: int  # c: the prefix is layers [0, c)

    def layers(self) -> Iterator[ProducedLayer]: ...

    def boundary(self) -> torch.Tensor: ...

    def head(self) -> torch.Tensor: ...


class FinishedPrefill:
    streamed = pipelined = False

    def __init__(self, state: PrefillOutput, token_ids: Sequence[int], cut: int,
                 through: int | None = None, input_rows: int = 0):
        self.state, self.token_ids, self.cut = state, token_ids, cut
        self.through = cut if through is None else through
        self.input_rows = input_rows
        if input_rows and not all(i in state.hidden for i in range(self.through)):
            raise ValueError("input_rows: the prefill did not keep every sent layer's input")
        self.device = state.keys[0].device if state.keys else torch.device("cpu")

    def layers(self) -> Iterator[ProducedLayer]:
        scores = self.state.importance
        for index in range(self.through):
            inputs = self.state.hidden[index][:self.input_rows] if self.input_rows else None
            yield ProducedLayer(index, self.state.keys[index], self.state.values[index],
                                scores[index] if index < len(scores) else None, inputs)

    def boundary(self) -> torch.Tensor:
        return self.state.hidden[self.cut]

    def head(self) -> torch.Tensor:
        return self.state.hidden[len(self.state.keys)][-1]


class _ComputingSource:
    """A source that computes as it is read: `compute_s`, and `on_done` called once (`close`)."""

    def __init__(self, on_done: Callable[[], None] | None):
        self.compute_s = 0.0
        self._on_done = on_done

    def close(self) -> None:
        """Call `on_done` if it was not yet called (idempotent)."""
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done()


class ReachedStates:
    """`boundary()` and `head()` of a source that computes as it is read: the rows leaving layer
    c − 1 (`_h`) and layer through − 1 (`_last`), once the compute has reached them."""

    _h: torch.Tensor | None = None
    _last: torch.Tensor | None = None

    def boundary(self) -> torch.Tensor:
        if self._h is None:
            raise RuntimeError("boundary: the prefill has not reached the cut")
        return self._h

    def head(self) -> torch.Tensor:
        if self._last is None:
            raise RuntimeError("head: the prefill has not reached its last layer")
        return self._last[-1]


class LivePrefill(_ComputingSource, ReachedStates):
    streamed, pipelined = True, False

    def __init__(self, model: Model, token_ids: Sequence[int], cut: int,
                 on_done: Callable[[], None] | None = None, importance_window: int = 0,
                 through: int | None = None, input_rows: int = 0):
        if not 0 <= cut <= model.shape.num_layers:
            raise ValueError(f"cut: must lie in [0, {model.shape.num_layers}], got {cut}")
        self.model, self.token_ids, self.cut = model, token_ids, cut
        self.through = cut if through is None else through
        if not cut <= self.through <= model.shape.num_layers:
            raise ValueError(f"through: must lie in [{cut}, {model.shape.num_layers}], got "
                             f"{self.through}")
        self.importance_window = importance_window
        self.input_rows = input_rows
        self.device = model.device
        super().__init__(on_done)
        self._h: torch.Tensor | None = None
        self._last: torch.Tensor | None = None

    def layers(self) -> Iterator[ProducedLayer]:
        if self.through == 0:  # token-only: nothing to compute
            self.close()
            return
        model = self.model
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                h = embed(model, self.token_ids)
                for step in iter_layers(model, h, 0, self.through,
                                        importance_window=self.importance_window):
                    if step.index == self.cut - 1:  # the cut: h_c exists with the layer's KV
                        self._h = step.hidden_out
                    if step.index == self.through - 1:
                        self._last = step.hidden_out
                        if model.device.type == "cuda":
                            torch.cuda.current_stream(model.device).synchronize()
                        self.close()
                    self.compute_s += time.perf_counter() - started
                    inputs = (step.hidden_in[:self.input_rows].clone() if self.input_rows
                              else None)  # not the whole [S, d] while it is in flight
                    yield ProducedLayer(step.index, step.keys, step.values, step.importance,
                                        inputs)
                    started = time.perf_counter()
        finally:
            self.close()


class ChunkedPrefill(_ComputingSource):
    streamed = pipelined = True

    def __init__(self, model: Model, token_ids: Sequence[int], cut: int, chunk_tokens: int,
                 on_done: Callable[[], None] | None = None):
        if not 0 < cut < model.shape.num_layers:
            raise ValueError(f"cut: a prefill in token chunks stops at an interior cut, in "
                             f"(0, {model.shape.num_layers}), got {cut}")
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens: a prefill in token chunks needs chunks, got "
                             f"{chunk_tokens}")
        self.model, self.token_ids, self.cut = model, token_ids, cut
        self.bounds = chunk_bounds(len(token_ids), chunk_tokens)
        self.device = model.device
        super().__init__(on_done)

    def chunks(self) -> Iterator[ProducedChunk]:
        model, shape, c = self.model, self.model.shape, self.cut
        cache = KVCache(c, shape.num_kv_heads, shape.head_dim, len(self.token_ids), model.dtype,
                        model.device)
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                for index, (s0, s1) in enumerate(self.bounds):
                    h = run_layers_chunk(model, embed(model, self.token_ids[s0:s1]), 0, s0,
                                         cache, stop=c)
                    layers = [ProducedLayer(i, cache.keys[i][:, s0:s1], cache.values[i][:, s0:s1])
                              for i in range(c)]
                    if index == len(self.bounds) - 1:
                        if model.device.type == "cuda":
                            torch.cuda.current_stream(model.device).synchronize()
                        self.close()
                    self.compute_s += time.perf_counter() - started
                    yield ProducedChunk(index, (s0, s1), h, layers)
                    started = time.perf_counter()
        finally:
            self.close()
