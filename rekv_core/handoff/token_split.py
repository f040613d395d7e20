"""KVPR's token split at the boundary: what it sends, and the decode side's cache from it.

With cut c and split l (`plan.token_split` chooses l), the prefill sends the boundary rows
h_c[0, l) (with c = 0 the boundary is the embedding, so it sends the token ids of [0, l)), the KV
of layers c..L−1 for tokens [l, S) in the action's codec, the KV of layers 0..c−1 for every token
in that codec, and, when l < S, the last position's final hidden state (`head`, as transfer-only
does: the last row is not recomputed, so the first token's logits come from it).

`split_wire_bytes` counts those bytes. `assemble_split_cache` builds the decode side's cache from
them: the received layers and rows are written as they came, and layers c..L−1 for tokens [0, l)
are recomputed from the boundary rows (`executor.run_layers_chunk` at position 0; causal
attention, so they need nothing of [l, S)). l must be a multiple of `EXEC_BLOCK` or S: then the
recomputed rows run the kernels the prefill ran for them, and are bit-identical to the prefill's
(from a lossless boundary); the received rows equal the codec's own round trip.

KVPR's per-layer form (`layer_split_wire_bytes`, `recompute_layer_kv`): for one layer, send its
input hidden states for tokens [0, l) and the layer's K and V for [l, S); the decode side
recomputes K and V of [0, l) (the layer's norm, K and V projections and RoPE at the original
positions), which equal the prefill's bit for bit on the same block grid. An input row is d values
against a K and V row's 2·n_kv·d_h, so it pays only where n_h < 2·n_kv (multi-head attention).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rekv_core.codecs import Codec
from rekv_core.handoff.action import WireBytes
from rekv_core.handoff.boundary import boundary_bytes
from rekv_core.model.blocks import EXEC_BLOCK
from rekv_core.model.cache import KVCache
from rekv_core.model.executor import run_layers_chunk
from rekv_core.model.layer import Model, project_qkv, rms_norm
from rekv_core.model.shapes import ModelShape
from rekv_core.units import BF16_BYTES, TOKEN_ID_BYTES

KV = tuple[torch.Tensor, torch.Tensor]  # K, V `[n_kv, rows, d_h]`


def check_split(num_layers: int, seq_len: int, cut: int, split: int) -> None:
    if not 0 <= cut < num_layers:
        raise ValueError(f"cut: a token split needs a cut in [0, {num_layers}), got {cut}")
    if not 0 <= split <= seq_len or (split % EXEC_BLOCK and split != seq_len):
        raise ValueError(f"split: must be a multiple of {EXEC_BLOCK} in [0, {seq_len}] or "
                         f"{seq_len}, got {split}")


def split_wire_bytes(shape: ModelShape, seq_len: int, cut: int, split: int, codec: Codec,
                     boundary: str = "bf16") -> WireBytes:
    check_split(shape.num_layers, seq_len, cut, split)
    n_kv, d_h = shape.num_kv_heads, shape.head_dim
    whole = codec.layer_bytes((n_kv, seq_len, d_h))
    rows = codec.layer_bytes((n_kv, seq_len - split, d_h)) if split < seq_len else None
    suffix_layers = shape.num_layers - cut
    sent = WireBytes(prefix=whole.data * cut, scales=whole.scales * cut)
    if rows is not None:
        sent += WireBytes(prefix=rows.data * suffix_layers, scales=rows.scales * suffix_layers,
                          head=shape.hidden_size * BF16_BYTES)
    if cut == 0:
        return sent + WireBytes(tokens=split * TOKEN_ID_BYTES)
    return sent + WireBytes(boundary=boundary_bytes(split * shape.hidden_size, boundary))


@torch.inference_mode()
def assemble_split_cache(model: Model, cut: int, boundary_rows: torch.Tensor,
                         prefix: Sequence[KV], suffix_rows: Sequence[KV], seq_len: int,
                         capacity: int) -> KVCache:
    """The cache of a token split: `prefix[i]` layer i's K, V for every token (i < cut),
    `suffix_rows[j]` layer cut + j's K, V for tokens [l, S), `boundary_rows` h_c for tokens
    [0, l) (`[l, d]`; with cut 0 the embedded token ids), in the model's dtype and device."""
    shape = model.shape
    split = boundary_rows.shape[0]
    check_split(shape.num_layers, seq_len, cut, split)
    if len(prefix) != cut or len(suffix_rows) != shape.num_layers - cut:
        raise ValueError(f"prefix/suffix_rows: need {cut} and {shape.num_layers - cut} layers, "
                         f"got {len(prefix)} and {len(suffix_rows)}")
    cache = KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, capacity, model.dtype,
                    model.device)
    for layer, (k, v) in enumerate(prefix):
        if k.shape[1] != seq_len:
            raise ValueError(f"prefix[{layer}]: {k.shape[1]} rows, the prompt has {seq_len}")
        cache.write(layer, 0, k, v)
    for offset, (k, v) in enumerate(suffix_rows):
        if k.shape[1] != seq_len - split:
            raise ValueError(f"suffix_rows[{offset}]: {k.shape[1]} rows, need {seq_len - split}")
        cache.write(cut + offset, split, k, v)
    if split:
        run_layers_chunk(model, boundary_rows, cut, 0, cache)
    cache.length = seq_len
    return cache


def layer_split_wire_bytes(shape: ModelShape, seq_len: int, split: int, codec: Codec) -> WireBytes:
    """One layer of the per-layer form: its BF16 input rows [0, l), its K and V of [l, S)."""
    check_split(shape.num_layers, seq_len, 0, split)
    sent = WireBytes(boundary=split * shape.hidden_size * BF16_BYTES)
    if split < seq_len:
        rows = codec.layer_bytes((shape.num_kv_heads, seq_len - split, shape.head_dim))
        sent += WireBytes(prefix=rows.data, scales=rows.scales)
    return sent


@torch.inference_mode()
def recompute_layer_kv(model: Model, layer: int, inputs: torch.Tensor) -> KV:
    """K and V `[n_kv, l, d_h]` of `layer` for tokens [0, l) from the layer's input rows `[l, d]`."""
    if not 0 <= layer < model.shape.num_layers:
        raise ValueError(f"layer: must lie in [0, {model.shape.num_layers}), got {layer}")
    lw = model.weights.layers[layer]
    cos, sin = model.rope(torch.arange(inputs.shape[0], device=inputs.device))
    _, k, v = project_qkv(model, lw, rms_norm(inputs, lw.attn_norm, model.shape.rms_eps), cos,
                          sin)
    return k, v
