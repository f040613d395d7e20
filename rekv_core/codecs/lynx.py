"""Lynx's progressive streams of an `int8` layer: an anchor the decode side can start on, and a
residual that makes it exact.

An `int8` layer's buffers (`k.codes`, `k.scales`, `v.codes`, `v.scales`: `groupwise`) split into
two messages' worth (`split_layer`): the anchor stream, `k.anchor`, `v.anchor` (the top four bits
of every code, two per byte) with the scales, and the residual stream, `k.residual`, `v.residual`
(the low four bits). Together they are the `int8` layer's bytes exactly: n codes become n/2 anchor
and n/2 residual bytes, the scales travel once, with the anchor. `anchor_kv` gives the layer's K
and V from the anchor alone (codes 16a + 8, within 8 code steps of the full codes: 8 × the group's
scale); `merge_layer` gives back the `int8` buffers bit for bit once the residual is in, for the
`int8` codec to decode. Arithmetic in `rekv_core.kernels` (Triton on CUDA, the reference elsewhere).
"""

from __future__ import annotations

import torch

from rekv_core.codecs.base import LayerBytes
from rekv_core.kernels import (GROUP_SIZE, dequantize_groupwise, lynx_anchor_codes, lynx_merge,
                               lynx_split)
from rekv_core.units import BF16_BYTES

BASE_CODEC = "int8"
HALVES = ("k", "v")


def split_layer(buffers: dict[str, torch.Tensor], backend: str = "auto"
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An `int8` layer's buffers -> (anchor buffers, residual buffers)."""
    anchor, residual = {}, {}
    for half in HALVES:
        anchor[f"{half}.anchor"], residual[f"{half}.residual"] = lynx_split(
            buffers[f"{half}.codes"], backend)
        anchor[f"{half}.scales"] = buffers[f"{half}.scales"]
    return anchor, residual


def merge_layer(anchor: dict[str, torch.Tensor], residual: dict[str, torch.Tensor],
                backend: str = "auto") -> dict[str, torch.Tensor]:
    """Both streams -> the `int8` layer's buffers, bit for bit."""
    buffers = {}
    for half in HALVES:
        buffers[f"{half}.codes"] = lynx_merge(anchor[f"{half}.anchor"],
                                              residual[f"{half}.residual"], backend)
        buffers[f"{half}.scales"] = anchor[f"{half}.scales"]
    return buffers


def anchor_kv(anchor: dict[str, torch.Tensor], shape: tuple[int, int, int], dtype: torch.dtype,
              backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `shape` from the anchor stream alone (the codes 16a + 8)."""
    return tuple(dequantize_groupwise(lynx_anchor_codes(anchor[f"{half}.anchor"], backend),
                                      anchor[f"{half}.scales"].view(torch.float16), 8, shape,
                                      dtype, backend)
                 for half in HALVES)


def stream_bytes(shape: tuple[int, int, int]) -> tuple[LayerBytes, LayerBytes]:
    """(anchor, residual) wire bytes of a layer of K and V `shape`: the anchor with the scales."""
    numel = shape[0] * shape[1] * shape[2]
    scales = 2 * numel // GROUP_SIZE * BF16_BYTES
    return LayerBytes(numel, scales), LayerBytes(numel, 0)
