"""`int4h`: Hadamard-rotated INT4 (seed spec §6). Each (head, token) row of K and/or V is rotated
along head_dim by a block-diagonal Sylvester Hadamard matrix, then quantized to INT4 with its own
asymmetric (scale, min); decode dequantizes and un-rotates, so the receiver gets ordinary K and V in
the source dtype and its attention kernels stay unchanged.

Rotation spreads a few large channels (post-RoPE keys have them) over the whole block, so the
per-row range no longer crushes the small channels. `rotate` picks the tensors that are rotated
("k", "v" or "kv"); the others get the same quantizer without rotation. `block` (a power of two
dividing head_dim, ≥ 2) defaults to head_dim when that is a power of two, else to its largest
power-of-two divisor.

Wire buffers, in order: `k.codes`, `k.scales`, `v.codes`, `v.scales`. Codes: INT4 nibbles, two per
byte; scales: FP16 (scale, min) per (head, token) row. Per layer: E·(1/2 + 4/d_h) bytes with
E = 2·S·n_kv·d_h — at d_h = 128 the same 4.25 bits per element as `int4`. Header `meta`:
{"block": B, "rotate": "k" | "v" | "kv"}; decode follows the header, not the decoder's own
settings. The arithmetic is in `rekv_core.kernels` (Triton on CUDA, the PyTorch reference elsewhere;
contract in `hadamard_reference.py`).
"""

from __future__ import annotations

import torch

from rekv_core.codecs.base import Codec, CorruptPayloadError
from rekv_core.kernels import dequantize_int4h, quantize_int4h
from rekv_core.kernels.hadamard_reference import default_block, is_power_of_two

ROTATIONS = ("k", "v", "kv")
DEFAULT_ROTATE = "kv"
ROW_SCALE_BYTES = 4  # FP16 scale and FP16 min per (head, token) row


def _check_block(block) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block < 2 or not is_power_of_two(
            block):
        raise ValueError(f"block: must be a power of two >= 2, got {block!r}")
    return block


class HadamardInt4Codec(Codec):
    name = "int4h"

    def __init__(self, rotate: str = DEFAULT_ROTATE, block: int | None = None,
                 backend: str = "auto"):
        if rotate not in ROTATIONS:
            raise ValueError(f"rotate: must be one of {ROTATIONS}, got {rotate!r}")
        self.rotate = rotate
        self.block = None if block is None else _check_block(block)
        self.backend = backend

    def block_for(self, head_dim: int) -> int:
        return self.block or default_block(head_dim)

    def check_shape(self, shape: tuple[int, int, int]) -> None:
        super().check_shape(shape)
        head_dim = shape[2]
        if head_dim % 2:
            raise ValueError(f"head_dim: int4h needs an even head_dim, got {head_dim}")
        if head_dim % self.block_for(head_dim):
            raise ValueError(f"head_dim: {head_dim} is not a multiple of the rotation block "
                             f"{self.block}")

    def buffer_layout(self, shape: tuple[int, int, int], meta: dict | None = None
                      ) -> dict[str, int]:
        rows = shape[0] * shape[1]
        codes, scales = rows * shape[2] // 2, rows * ROW_SCALE_BYTES
        return {"k.codes": codes, "k.scales": scales, "v.codes": codes, "v.scales": scales}

    def check_meta(self, meta: dict, shape: tuple[int, int, int]) -> None:
        if set(meta) != {"block", "rotate"}:
            raise CorruptPayloadError(f"meta: int4h needs exactly block and rotate, got "
                                      f"{sorted(meta)}")
        try:
            block = _check_block(meta["block"])
        except ValueError as exc:
            raise CorruptPayloadError(f"meta.{exc}") from None
        if shape[2] % block:
            raise CorruptPayloadError(f"meta.block: {block} does not divide head_dim {shape[2]}")
        if meta["rotate"] not in ROTATIONS:
            raise CorruptPayloadError(f"meta.rotate: must be one of {ROTATIONS}, got "
                                      f"{meta['rotate']!r}")

    def _encode(self, k, v, context):
        block = self.block_for(k.shape[2])
        buffers = {}
        for name, t in (("k", k), ("v", v)):
            codes, scales = quantize_int4h(t, block if name in self.rotate else 1, self.backend)
            buffers[f"{name}.codes"] = codes
            buffers[f"{name}.scales"] = scales.reshape(-1).view(torch.uint8)
        return buffers, {"block": block, "rotate": self.rotate}

    def _decode(self, buffers, shape, dtype, meta):
        block, rotate = meta["block"], meta["rotate"]
        return tuple(dequantize_int4h(buffers[f"{name}.codes"],
                                      buffers[f"{name}.scales"].view(torch.float16),
                                      block if name in rotate else 1, shape, dtype, self.backend)
                     for name in ("k", "v"))
