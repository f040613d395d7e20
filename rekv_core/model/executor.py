"""The decoder executor: pure functions from tensors to tensors, one sequence at a time.

The three operations the handoff needs:

- `prefill(model, token_ids)` runs the whole prompt and returns every layer's K and V, the hidden
  state entering any requested layer c (`h_c`, the residual stream before layer c's input norm) and
  the last position's logits.
- `run_layers(model, h_c, start=c)` runs layers [c, L) from a boundary hidden state at positions
  [0, S) and returns those layers' K, V and the last logits. Given the `h_c` that `prefill` produced,
  on the same device and dtype, its K and V are bit-identical to the prefill's: both go through
  `iter_layers`, the same kernels on the same shapes.
- `decode_step(model, token_id, cache)` appends one token to a `KVCache` and returns its logits;
  `decode_steps(model, cache)` gives the fastest step this device has for one sequence (on CUDA a
  graph replay, `static_decode`).

`iter_layers` yields layer by layer, so a caller can stream a layer's KV while later layers still
compute, or stop early at a cut. `run_layers_chunk(model, h, start, pos, cache)` runs layers
[start, L) for the rows [pos, pos + n) of a boundary state, attending to the earlier rows' K and V
in `cache` (chunked prefill over the suffix).

Every kernel of a layer runs over aligned blocks of `EXEC_BLOCK` positions (`blocks`), so a
suffix run in chunks whose starts are multiples of the block issues exactly the kernels the
unchunked run issues, and its K, V and logits are bit-identical to it (`chunk_bounds` gives such
chunks). It costs a few percent of a long prompt's prefill on the CPU. Shapes: h
`[S, d]`; K, V per layer `[n_kv, S, d_h]`; logits `[vocab]` in float32.

The layer body itself, the `Model` and `final_logits` live in `layer`, which the static decode
step (`static_decode`) shares; `Model` and `final_logits` are importable from here as well.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rekv_core.model.blocks import EXEC_BLOCK
from rekv_core.model.cache import KVCache
from rekv_core.model.layer import Model, final_logits, layer_forward
from rekv_core.model.static_decode import StaticDecoder


def validate_token_ids(token_ids: Sequence[int] | torch.Tensor, vocab_size: int) -> torch.Tensor:
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("token_ids: the prompt is empty")
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"token_ids: id {int(ids[i])} at position {i} is outside the "
                         f"vocabulary [0, {vocab_size})")
    return ids


@dataclass
class LayerStep:
    index: int
    hidden_in: torch.Tensor  # [S, d]: h_index, the residual stream entering this layer
    keys: torch.Tensor  # [n_kv, S, d_h]
    values: torch.Tensor  # [n_kv, S, d_h]
    hidden_out: torch.Tensor  # [S, d]
    importance: torch.Tensor | None = None  # [S]: with `importance_window` (`model.importance`)


def iter_layers(model: Model, h: torch.Tensor, start: int = 0, stop: int | None = None,
                positions: torch.Tensor | None = None, importance_window: int = 0
                ) -> Iterator[LayerStep]:
    """Run layers [start, stop) from `h` (the hidden state entering `start`), one at a time.
    `importance_window` > 0: each step also scores every token by the attention it receives from
    the last that many queries (`importance.observation_window_importance`)."""
    stop = model.shape.num_layers if stop is None else stop
    if not 0 <= start <= stop <= model.shape.num_layers:
        raise ValueError(f"layers [{start}, {stop}) are outside [0, {model.shape.num_layers}]")
    if positions is None:
        positions = torch.arange(h.shape[0], device=h.device)
    cos, sin = model.rope(positions)
    scores: list[torch.Tensor] = []

    def observe(q: torch.Tensor, k: torch.Tensor) -> None:
        from rekv_core.model.importance import observation_window_importance
        scores.append(observation_window_importance(q, k, importance_window))

    for index in range(start, stop):
        h_out, k, v = layer_forward(model, index, h, cos, sin,
                             observe=observe if importance_window > 0 else None)
        yield LayerStep(index=index, hidden_in=h, keys=k, values=v, hidden_out=h_out,
                        importance=scores.pop() if scores else None)
        h = h_out


def embed(model: Model, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    ids = validate_token_ids(token_ids, model.shape.vocab_size).to(model.device)
    return F.embedding(ids, model.weights.embed)  # [S, d]


@dataclass
class PrefillOutput:
    keys: list[torch.Tensor]  # per layer [n_kv, S, d_h]
    values: list[torch.Tensor]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # c -> h_c [S, d]
    logits: torch.Tensor | None = None  # [vocab] at the last position
    importance: list[torch.Tensor] = field(default_factory=list)  # per layer [S], if asked for


@torch.inference_mode()
def prefill(model: Model, token_ids: Sequence[int] | torch.Tensor,
            boundaries: Collection[int] | None = None, importance_window: int = 0
            ) -> PrefillOutput:
    """Run the prompt through all layers. `boundaries` selects which h_c to keep (c in [0, L]);
    None keeps all L+1 of them. `importance_window` > 0: also each layer's token importance."""
    n_layers = model.shape.num_layers
    keep = set(range(n_layers + 1)) if boundaries is None else set(boundaries)
    if any(not 0 <= c <= n_layers for c in keep):
        raise ValueError(f"boundaries: every cut must lie in [0, {n_layers}], got {sorted(keep)}")
    h = embed(model, token_ids)
    out = PrefillOutput(keys=[], values=[])
    for step in iter_layers(model, h, importance_window=importance_window):
        if step.index in keep:
            out.hidden[step.index] = step.hidden_in
        out.keys.append(step.keys)
        out.values.append(step.values)
        if step.importance is not None:
            out.importance.append(step.importance)
        h = step.hidden_out
    if n_layers in keep:
        out.hidden[n_layers] = h
    out.logits = final_logits(model, h[-1])
    return out


@dataclass
class SuffixOutput:
    start: int  # c
    keys: list[torch.Tensor]  # layers [c, L), each [n_kv, S, d_h]
    values: list[torch.Tensor]
    logits: torch.Tensor  # [vocab]


@torch.inference_mode()
def run_layers(model: Model, h_c: torch.Tensor, start: int) -> SuffixOutput:
    """Recompute layers [start, L) from the boundary state entering `start` (positions 0..S-1)."""
    if h_c.dim() != 2 or h_c.shape[1] != model.shape.hidden_size:
        raise ValueError(f"h_c: expected shape [S, {model.shape.hidden_size}], "
                         f"got {list(h_c.shape)}")
    if h_c.dtype != model.dtype:
        raise ValueError(f"h_c: dtype {h_c.dtype} differs from the model's {model.dtype}")
    keys, values, h = [], [], h_c
    for step in iter_layers(model, h_c, start=start):
        keys.append(step.keys)
        values.append(step.values)
        h = step.hidden_out
    return SuffixOutput(start=start, keys=keys, values=values, logits=final_logits(model, h[-1]))


def check_layer_run(model: Model, rows: int, start: int, stop: int, pos: int,
                    cache: KVCache) -> None:
    """ValueError naming what is wrong with running `rows` rows at `pos` through layers
    [start, stop) into `cache` (`run_layers_chunk`'s arguments)."""
    if pos % EXEC_BLOCK:
        raise ValueError(f"pos: must be a multiple of {EXEC_BLOCK}, got {pos}")
    if pos + rows > cache.capacity:
        raise ValueError(f"cache: rows [{pos}, {pos + rows}) exceed its capacity of "
                         f"{cache.capacity}")
    if not 0 <= start <= stop <= model.shape.num_layers:
        raise ValueError(f"layers [{start}, {stop}) are outside [0, {model.shape.num_layers}]")


@torch.inference_mode()
def run_layers_chunk(model: Model, h: torch.Tensor, start: int, pos: int, cache: KVCache,
                     stop: int | None = None) -> torch.Tensor:
    """Run layers [start, stop) (stop: L by default) for the rows [pos, pos + n) in `h` `[n, d]`,
    attending to the K and V of rows [0, pos) already in `cache`; writes this chunk's K and V there
    and returns the residual states leaving layer stop − 1 `[n, d]`. `pos` must be a multiple of
    `EXEC_BLOCK` (`chunk_bounds`). From `embed`'s rows with start 0 and stop c, a prefill run in
    token chunks up to the cut: its h_c rows are the unchunked prefill's."""
    n = h.shape[0]
    stop = model.shape.num_layers if stop is None else stop
    check_layer_run(model, n, start, stop, pos, cache)
    cos, sin = model.rope(torch.arange(pos, pos + n, device=h.device))

    def store(index: int, k: torch.Tensor, v: torch.Tensor):
        cache.write(index, pos, k, v)
        return cache.layer(index, pos + n)

    for step in range(start, stop):
        h, _, _ = layer_forward(model, step, h, cos, sin, store, causal_from=pos)
    return h


def _append(model: Model, token_ids: Sequence[int] | torch.Tensor, cache: KVCache
            ) -> torch.Tensor:
    """Run `token_ids` through every layer at positions `cache.length`…, appending their K and V;
    returns the final residual states `[n, d]`."""
    ids = validate_token_ids(token_ids, model.shape.vocab_size)
    n, pos = ids.numel(), cache.length
    if pos + n > cache.capacity:
        raise ValueError(f"cache: {n} token(s) at position {pos} exceed its capacity of "
                         f"{cache.capacity}")
    h = embed(model, ids)
    cos, sin = model.rope(torch.arange(pos, pos + n, device=model.device))
    # one token attends to the whole cache; several attend causally among themselves
    mask = None if n == 1 else (torch.arange(pos + n, device=model.device)[None, :]
                                <= torch.arange(pos, pos + n, device=model.device)[:, None])

    def store(index: int, k: torch.Tensor, v: torch.Tensor):
        cache.write(index, pos, k, v)
        return cache.layer(index, pos + n)

    for index in range(model.shape.num_layers):
        h, _, _ = layer_forward(model, index, h, cos, sin, store, mask)
    cache.length = pos + n
    return h


@torch.inference_mode()
def extend(model: Model, token_ids: Sequence[int] | torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Append `token_ids` at positions `cache.length`… in one pass (each attends to the cache and to
    the new tokens before it); return the logits after every one of them, `[n, vocab]` float32.
    Teacher-forced scoring of a continuation from a cache the handoff built."""
    return final_logits(model, _append(model, token_ids, cache))


@torch.inference_mode()
def decode_step(model: Model, token_id: int, cache: KVCache) -> torch.Tensor:
    """`extend` by one token: append it at position `cache.length`; return its logits `[vocab]`."""
    return final_logits(model, _append(model, [token_id], cache)[-1])


def greedy_generate(model: Model, token_ids: Sequence[int], max_new_tokens: int,
                    eos_token_id: int | None = None) -> list[int]:
    """Reference generation: prefill, then greedy decode steps. Returns the new token ids."""
    out = prefill(model, token_ids, boundaries=())
    cache = KVCache.from_layers(out.keys, out.values, capacity=len(token_ids) + max_new_tokens)
    return decode_greedy(model, out.logits, cache, max_new_tokens, eos_token_id)


def decode_greedy(model: Model, first_logits: torch.Tensor, cache: KVCache, max_new_tokens: int,
                  eos_token_id: int | None = None) -> list[int]:
    """Greedy continuation from the first-token logits of a filled cache (`decode_steps`)."""
    step = decode_steps(model, cache)
    tokens: list[int] = []
    logits = first_logits
    for _ in range(max_new_tokens):
        token = int(torch.argmax(logits))
        tokens.append(token)
        if token == eos_token_id or len(tokens) == max_new_tokens:
            break
        logits = step(token)
    return tokens


GRAPH_MIN_STEPS = 16  # fewer steps than this do not repay a CUDA graph's capture


def decode_steps(model: Model, cache: KVCache) -> Callable[[int], torch.Tensor]:
    """One sequence's decode step, token id -> logits: replays of a CUDA graph on a GPU when the
    cache has room for at least `GRAPH_MIN_STEPS` more tokens (`static_decode.StaticDecoder`),
    `decode_step` otherwise."""
    if model.device.type == "cuda" and cache.capacity - cache.length >= GRAPH_MIN_STEPS:
        return StaticDecoder(model, cache).step
    return lambda token: decode_step(model, token, cache)
