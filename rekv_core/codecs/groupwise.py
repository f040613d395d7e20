"""`int8` and `int4`: symmetric group-wise quantization, groups of 64 along head_dim, one FP16 scale
per group, INT4 packed two per byte. Per layer: E·(b/8 + 2/64) bytes with E = 2·S·n_kv·d_h (eq. 7).

Wire buffers, in order: `k.codes`, `k.scales`, `v.codes`, `v.scales`. The arithmetic is in
`rekv_core.kernels` (Triton on CUDA, the PyTorch reference elsewhere).
"""

from __future__ import annotations

import torch

from rekv_core.codecs.base import Codec
from rekv_core.kernels import GROUP_SIZE, dequantize_groupwise, quantize_groupwise
from rekv_core.units import BF16_BYTES


class GroupwiseIntCodec(Codec):
    def __init__(self, bits: int, backend: str = "auto"):
        self.bits = bits
        self.backend = backend
        self.name = f"int{bits}"

    def check_shape(self, shape: tuple[int, int, int]) -> None:
        super().check_shape(shape)
        if shape[2] % GROUP_SIZE:
            raise ValueError(f"head_dim: {self.name} needs a multiple of {GROUP_SIZE}, "
                             f"got {shape[2]}")

    def buffer_layout(self, shape: tuple[int, int, int], meta: dict | None = None
                      ) -> dict[str, int]:
        numel = shape[0] * shape[1] * shape[2]
        codes, scales = numel * self.bits // 8, numel // GROUP_SIZE * BF16_BYTES  # FP16 scales
        return {"k.codes": codes, "k.scales": scales, "v.codes": codes, "v.scales": scales}

    def _encode(self, k, v, context):
        buffers = {}
        for name, t in (("k", k), ("v", v)):
            codes, scales = quantize_groupwise(t, self.bits, self.backend)
            buffers[f"{name}.codes"] = codes
            buffers[f"{name}.scales"] = scales.view(torch.uint8)
        return buffers, {}

    def _decode(self, buffers, shape, dtype, meta):
        return tuple(dequantize_groupwise(buffers[f"{name}.codes"],
                                          buffers[f"{name}.scales"].view(torch.float16),
                                          self.bits, shape, dtype, self.backend)
                     for name in ("k", "v"))
