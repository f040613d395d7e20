"""PyTorch reference of symmetric group-wise INT8/INT4 quantization (the CPU path).

Contract, shared bit for bit with the Triton kernels in `groupwise_triton.py`:
- the input is split into groups of `GROUP_SIZE` (64) consecutive elements of the flattened tensor;
  since the group size divides the last dimension (head_dim), a group never straddles two rows;
- scale = fp16(min(absmax / qmax, 65504)) with qmax = 127 (INT8) or 7 (INT4), all in float32 with
  IEEE division, rounded to nearest-even into float16;
- code = sign(y)·min(floor(|y| + 0.5), qmax) with y = x / scale (a zero scale divides by 1), i.e.
  round half away from zero; the bound |x − code·scale| ≤ scale/2 holds for every element;
- INT8 codes are stored as int8 bytes; INT4 codes as offset-binary nibbles (code + 8), two per byte,
  element 2j in the low nibble and 2j+1 in the high nibble;
- dequantization is fp32(code) · fp32(scale), rounded to the output dtype.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 64
QMAX = {8: 127, 4: 7}
FP16_MAX = 65504.0


def check_bits(bits: int) -> int:
    if bits not in QMAX:
        raise ValueError(f"bits: must be one of {sorted(QMAX)}, got {bits}")
    return QMAX[bits]


def code_bytes(numel: int, bits: int) -> int:
    return numel * bits // 8


def quantize_reference(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, numel divisible by 64) -> (codes uint8 [numel·bits/8], scales fp16 [numel/64])."""
    qmax = check_bits(bits)
    groups = x.reshape(-1, GROUP_SIZE).to(torch.float32)
    absmax = groups.abs().amax(dim=1)
    scales = torch.clamp(absmax / qmax, max=FP16_MAX).to(torch.float16)
    s = scales.to(torch.float32)
    y = groups / torch.where(s == 0, torch.ones_like(s), s)[:, None]
    codes = torch.clamp(torch.floor(y.abs() + 0.5), max=qmax)
    codes = torch.where(y < 0, -codes, codes).to(torch.int8)
    if bits == 8:
        return codes.reshape(-1).view(torch.uint8), scales
    nibbles = (codes.to(torch.int16) + 8).reshape(-1, 2)
    packed = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return packed.to(torch.uint8), scales


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Wire codes -> signed integer codes, one int8 per element."""
    check_bits(bits)
    if bits == 8:
        return codes.view(torch.int8)
    as_int = codes.to(torch.int16)
    low, high = (as_int & 0xF) - 8, (as_int >> 4) - 8
    return torch.stack((low, high), dim=1).reshape(-1).to(torch.int8)


def dequantize_reference(codes: torch.Tensor, scales: torch.Tensor, bits: int,
                         shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    values = unpack_codes(codes, bits).to(torch.float32).reshape(-1, GROUP_SIZE)
    return (values * scales.to(torch.float32)[:, None]).to(dtype).reshape(shape)
