"""`bf16`: K and V sent as BF16, two bytes per element (eq. 2). Lossless for BF16 input; float32
input is rounded to BF16 on the wire and restored to float32 by decode."""

from __future__ import annotations

import torch

from rekv_core.codecs.base import Codec
from rekv_core.units import BF16_BYTES


class BF16Codec(Codec):
    name = "bf16"
    lossless = True
    restore_is_copy = True

    def buffer_layout(self, shape: tuple[int, int, int], meta: dict | None = None
                      ) -> dict[str, int]:
        n = shape[0] * shape[1] * shape[2] * BF16_BYTES
        return {"k": n, "v": n}

    def _encode(self, k, v, context):
        return {name: t.to(torch.bfloat16).reshape(-1).view(torch.uint8)
                for name, t in (("k", k), ("v", v))}, {}

    def _decode(self, buffers, shape, dtype, meta):
        return tuple(buffers[name].view(torch.bfloat16).reshape(shape).to(dtype)
                     for name in ("k", "v"))
