"""One layer over several prompts' rows at once: the step a prefill scheduler batches.

`layer_forward_batch(model, index, segments, invariant=False)` runs layer `index` over a list of
`Segment`s, each one request's rows [pos, pos + n) entering that layer, and returns a
`SegmentOut` (h_out, K, V of those rows) per segment, in order. A segment at `pos` > 0 continues
an earlier part of the same prompt at this layer: its `cache` holds this layer's K and V of rows
[0, pos), its rows attend to them and to each other causally, and the step writes its own K and V
there (rows [pos, pos + n)). A segment at 0 may have a cache too (the step writes into it) or none.

Two modes, the guarantee each gives:

- shared (the default): RMSNorm, the Q/K/V, output and MLP projections run once over every
  segment's rows stacked (one GEMM per weight per step: the weights are read once for the batch
  instead of once per request); RoPE uses each row's own position, and attention runs per segment
  over exactly its own keys. Each segment's results agree with the same rows run alone to the
  rounding of a GEMM over more rows (a BLAS library may pick another kernel for another row count).
- invariant: each segment runs the same kernels, on the same shapes, as it would alone
  (`layer.layer_forward`, as `executor.iter_layers` and `run_layers_chunk` call it), so its K, V and
  h_out are bit-identical to a lone run, whatever else is in the batch. The step still serves the
  whole batch in one call; it saves no weight reads.

A segment's `pos` must be a multiple of `EXEC_BLOCK` (the blocks that make a chunked run
bit-identical to an unchunked one, `blocks`). Shapes: h `[n, d]`; K, V `[n_kv, n, d_h]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rekv_core.model.blocks import EXEC_BLOCK, attend_causal, linear
from rekv_core.model.cache import KVCache
from rekv_core.model.layer import Model, layer_forward, mlp, project_qkv, rms_norm


@dataclass(frozen=True)
class Segment:
    h: torch.Tensor  # [n, d]: rows [pos, pos + n) of the residual stream entering the layer
    pos: int = 0  # the first row's position
    cache: KVCache | None = None  # this layer's K, V of rows [0, pos); the step adds its own


@dataclass(frozen=True)
class SegmentOut:
    h: torch.Tensor  # [n, d]: the rows leaving the layer
    keys: torch.Tensor  # [n_kv, n, d_h]: the segment's own rows
    values: torch.Tensor


def check_segments(model: Model, segments: Sequence[Segment]) -> None:
    """ValueError naming the segment and what is wrong with it."""
    if not segments:
        raise ValueError("segments: need at least one")
    d = model.shape.hidden_size
    for i, seg in enumerate(segments):
        if seg.h.dim() != 2 or seg.h.shape[1] != d or seg.h.shape[0] == 0:
            raise ValueError(f"segments[{i}].h: expected shape [n > 0, {d}], got "
                             f"{list(seg.h.shape)}")
        if seg.h.dtype != model.dtype:
            raise ValueError(f"segments[{i}].h: dtype {seg.h.dtype} differs from the model's "
                             f"{model.dtype}")
        if seg.pos < 0 or seg.pos % EXEC_BLOCK:
            raise ValueError(f"segments[{i}].pos: must be a non-negative multiple of "
                             f"{EXEC_BLOCK}, got {seg.pos}")
        if seg.pos and seg.cache is None:
            raise ValueError(f"segments[{i}].cache: rows at position {seg.pos} need the cache "
                             f"of rows [0, {seg.pos})")
        if seg.cache is not None and seg.pos + seg.h.shape[0] > seg.cache.capacity:
            raise ValueError(f"segments[{i}].cache: rows [{seg.pos}, "
                             f"{seg.pos + seg.h.shape[0]}) exceed its capacity of "
                             f"{seg.cache.capacity}")


def _store(seg: Segment):
    """The `KVStore` of a segment with a cache: write its rows, give back rows [0, pos + n)."""
    end = seg.pos + seg.h.shape[0]

    def store(index: int, k: torch.Tensor, v: torch.Tensor):
        seg.cache.write(index, seg.pos, k, v)
        return seg.cache.layer(index, end)
    return store


def _alone(model: Model, index: int, seg: Segment) -> SegmentOut:
    n = seg.h.shape[0]
    cos, sin = model.rope(torch.arange(seg.pos, seg.pos + n, device=seg.h.device))
    if seg.cache is None:
        h, k, v = layer_forward(model, index, seg.h, cos, sin)
    else:
        h, k, v = layer_forward(model, index, seg.h, cos, sin, _store(seg), causal_from=seg.pos)
    return SegmentOut(h, k, v)


@torch.inference_mode()
def layer_forward_batch(model: Model, index: int, segments: Sequence[Segment],
                        invariant: bool = False) -> list[SegmentOut]:
    """Layer `index` over `segments` (see the module's docstring for the two modes)."""
    check_segments(model, segments)
    if not 0 <= index < model.shape.num_layers:
        raise ValueError(f"index: layer {index} is outside [0, {model.shape.num_layers})")
    if invariant or len(segments) == 1:
        return [_alone(model, index, seg) for seg in segments]
    lw = model.weights.layers[index]
    eps = model.shape.rms_eps
    sizes = [seg.h.shape[0] for seg in segments]
    h = torch.cat([seg.h for seg in segments])
    positions = torch.cat([torch.arange(seg.pos, seg.pos + n, device=h.device)
                           for seg, n in zip(segments, sizes)])
    cos, sin = model.rope(positions)
    q, k, v = project_qkv(model, lw, rms_norm(h, lw.attn_norm, eps), cos, sin)
    outs, keys, values = [], [], []
    start = 0
    for seg, n in zip(segments, sizes):
        rows = slice(start, start + n)
        q_i, k_i, v_i = q[:, rows], k[:, rows].contiguous(), v[:, rows].contiguous()
        if seg.cache is None:
            outs.append(attend_causal(q_i, k_i, v_i))
        else:
            k_all, v_all = _store(seg)(index, k_i, v_i)
            outs.append(attend_causal(q_i, k_all, v_all, seg.pos))
        keys.append(k_i)
        values.append(v_i)
        start += n
    h = h + linear(torch.cat(outs), lw.wo)
    h = h + mlp(lw, rms_norm(h, lw.mlp_norm, eps))
    return [SegmentOut(part, k_i, v_i)
            for part, k_i, v_i in zip(h.split(sizes), keys, values)]
