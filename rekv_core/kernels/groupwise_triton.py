"""Triton kernels for symmetric group-wise INT8/INT4 quantization (the CUDA path).

Bit-for-bit the contract of `groupwise_reference.py`: same groups, same float32 IEEE arithmetic
(`div_rn`, not Triton's approximate division), same round-half-away-from-zero, same nibble layout.
Run on the CPU under `TRITON_INTERPRET=1` for tests. Launchers check their inputs and name what they
cannot handle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rekv_core.kernels.groupwise_reference import FP16_MAX, GROUP_SIZE, check_bits, code_bytes
from rekv_core.kernels.rounding_triton import scale_and_codes, to_output

# 16 groups (1024 elements) per program: a power of two that keeps one program's registers small
# while giving each program enough bytes to stream. Not tuned on hardware yet.
GROUPS_PER_PROGRAM = 16


@triton.jit
def _quantize_int8_kernel(x_ptr, codes_ptr, scales_ptr, n_groups, GROUP: tl.constexpr,
                          BLOCK: tl.constexpr, QMAX: tl.constexpr, FMAX: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < n_groups
    offs = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_ptr + offs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    scale, q = scale_and_codes(x, tl.max(tl.abs(x), axis=1), QMAX, FMAX)
    tl.store(codes_ptr + offs, q.to(tl.int8), mask=row_ok[:, None])
    tl.store(scales_ptr + rows, scale, mask=row_ok)


@triton.jit
def _quantize_int4_kernel(x_ptr, codes_ptr, scales_ptr, n_groups, GROUP: tl.constexpr,
                          BLOCK: tl.constexpr, QMAX: tl.constexpr, FMAX: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < n_groups
    pairs = tl.arange(0, GROUP // 2)
    even = rows[:, None] * GROUP + 2 * pairs[None, :]
    x_even = tl.load(x_ptr + even, mask=row_ok[:, None], other=0.0).to(tl.float32)
    x_odd = tl.load(x_ptr + even + 1, mask=row_ok[:, None], other=0.0).to(tl.float32)
    absmax = tl.maximum(tl.max(tl.abs(x_even), axis=1), tl.max(tl.abs(x_odd), axis=1))
    scale, q_even = scale_and_codes(x_even, absmax, QMAX, FMAX)
    _, q_odd = scale_and_codes(x_odd, absmax, QMAX, FMAX)
    packed = (q_even.to(tl.int32) + 8) | ((q_odd.to(tl.int32) + 8) << 4)
    tl.store(codes_ptr + rows[:, None] * (GROUP // 2) + pairs[None, :], packed.to(tl.uint8),
             mask=row_ok[:, None])
    tl.store(scales_ptr + rows, scale, mask=row_ok)


@triton.jit
def _dequantize_int8_kernel(codes_ptr, scales_ptr, out_ptr, n_groups, GROUP: tl.constexpr,
                            BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < n_groups
    offs = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    q = tl.load(codes_ptr + offs, mask=row_ok[:, None], other=0).to(tl.float32)
    s = tl.load(scales_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, to_output(q * s[:, None], out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _dequantize_int4_kernel(codes_ptr, scales_ptr, out_ptr, n_groups, GROUP: tl.constexpr,
                            BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < n_groups
    pairs = tl.arange(0, GROUP // 2)
    packed = tl.load(codes_ptr + rows[:, None] * (GROUP // 2) + pairs[None, :],
                     mask=row_ok[:, None], other=0).to(tl.int32)
    s = tl.load(scales_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    low = ((packed & 0xF) - 8).to(tl.float32) * s
    high = ((packed >> 4) - 8).to(tl.float32) * s
    even = rows[:, None] * GROUP + 2 * pairs[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + even, to_output(low, dtype), mask=row_ok[:, None])
    tl.store(out_ptr + even + 1, to_output(high, dtype), mask=row_ok[:, None])


def _check_input(x: torch.Tensor) -> int:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x: dtype must be bfloat16, float16 or float32, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("x: must be contiguous")
    if x.dim() == 0 or x.shape[-1] % GROUP_SIZE:
        raise ValueError(f"x: last dimension must be a multiple of {GROUP_SIZE}, "
                         f"got shape {tuple(x.shape)}")
    return x.numel() // GROUP_SIZE


def _grid(n_groups: int) -> tuple[int]:
    return (triton.cdiv(n_groups, GROUPS_PER_PROGRAM),)


def quantize_triton(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `quantize_reference`."""
    qmax = check_bits(bits)
    n_groups = _check_input(x)
    codes = torch.empty(code_bytes(x.numel(), bits), dtype=torch.uint8, device=x.device)
    scales = torch.empty(n_groups, dtype=torch.float16, device=x.device)
    if n_groups:
        kernel = _quantize_int8_kernel if bits == 8 else _quantize_int4_kernel
        target = codes.view(torch.int8) if bits == 8 else codes
        kernel[_grid(n_groups)](x, target, scales, n_groups, GROUP=GROUP_SIZE,
                                BLOCK=GROUPS_PER_PROGRAM, QMAX=float(qmax), FMAX=FP16_MAX)
    return codes, scales


def dequantize_triton(codes: torch.Tensor, scales: torch.Tensor, bits: int,
                      shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Same contract as `dequantize_reference`."""
    check_bits(bits)
    out = torch.empty(shape, dtype=dtype, device=codes.device)
    n_groups = scales.numel()
    if out.numel() != n_groups * GROUP_SIZE or codes.numel() != code_bytes(out.numel(), bits):
        raise ValueError(f"codes/scales: {codes.numel()} code bytes and {n_groups} scales do not "
                         f"describe shape {tuple(shape)} at {bits} bits")
    if n_groups:
        if bits == 8:
            _dequantize_int8_kernel[_grid(n_groups)](codes.view(torch.int8), scales, out,
                                                     n_groups, GROUP=GROUP_SIZE,
                                                     BLOCK=GROUPS_PER_PROGRAM)
        else:
            _dequantize_int4_kernel[_grid(n_groups)](codes, scales, out, n_groups,
                                                     GROUP=GROUP_SIZE, BLOCK=GROUPS_PER_PROGRAM)
    return out
