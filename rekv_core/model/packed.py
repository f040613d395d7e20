"""Decode-step weights prepacked for the CPU's GEMM library (oneDNN), for the batched step.

On the CPU a decode step multiplies a handful of rows (the batch) by every weight, and PyTorch's
default GEMM handles that shape poorly: measured on one core (AMD EPYC, float32, the LM head of
SmolLM2), 8 rows take 20 ms through `F.linear` and 8.4 ms through oneDNN with the weight packed
once into its blocked layout, 32 rows 35 against 20 ms. `PackedLinears.for_model(model)` packs
every weight the batched decode step multiplies by (each layer's fused QKV, output, gate-up and
down projections, and the LM head) once; `linear(x, weight, bias)` then uses the packed copy of
`weight` (looked up by identity), or `blocks.linear` for any other weight. It returns None where
packing does not apply: not on the CPU, or this PyTorch build has no oneDNN linear.

Cost: a second copy of those weights in host memory. Results agree with `F.linear` to float
rounding (another summation order), not bit for bit: only the batched decode step uses them; the
prefill-like paths, whose results must not depend on how they are chunked, keep `blocks.linear`.
"""

from __future__ import annotations

import logging

import torch

from rekv_core.model.blocks import linear as block_linear
from rekv_core.model.layer import Model

log = logging.getLogger("rekv.model.packed")

_LAYER_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")


def _packing_works(dtype: torch.dtype) -> bool:
    try:
        weight = torch.ones(16, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), packed, None,
                                                 "none", [], "")
        return bool(torch.all(out == 8))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


class PackedLinears:
    def __init__(self, packed: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self._packed = packed  # id(weight) -> (weight, its packed copy); the weight kept alive

    @classmethod
    def for_model(cls, model: Model) -> PackedLinears | None:
        if model.device.type != "cpu" or not torch.backends.mkldnn.is_available() or (
                not _packing_works(model.dtype)):
            return None
        weights = [getattr(lw, name) for lw in model.weights.layers for name in _LAYER_WEIGHTS]
        weights.append(model.weights.lm_head)
        packed = {}
        for weight in weights:
            if id(weight) not in packed:
                packed[id(weight)] = (weight, torch.ops.mkldnn._reorder_linear_weight(weight))
        log.info("packed %d decode weights for oneDNN (%.0f MiB)", len(packed),
                 sum(w.numel() * w.element_size() for w, _ in packed.values()) / 2**20)
        return cls(packed)

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        entry = self._packed.get(id(weight))
        if entry is None or x.dim() != 2:
            return block_linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, entry[1], bias, "none", [], "")
