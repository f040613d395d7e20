"""Triton kernels for Hadamard-rotated INT4 (the CUDA path): rotate+quantize and
dequantize+unrotate, each fused in one pass over the rows.

Bit-for-bit the contract of `hadamard_reference.py`: the same butterfly stages in the same order,
the same power-of-two scalings, `div_rn` (not Triton's approximate division), the same directed FP16
roundings, the same nibble layout. Fused multiply-adds cannot change a result: the only product
that meets an addition, code·scale, is exact in float32. One program handles `rows_per_program`
whole rows, padded to a power of two of columns. Run on the CPU under `TRITON_INTERPRET=1` for
tests. Launchers check their inputs and name what they cannot handle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rekv_core.kernels.rounding_triton import to_output
from rekv_core.kernels.hadamard_reference import (
    FP16_MAX,
    QMAX,
    check_block,
    check_sizes,
    log2,
    rotation_scales,
)

# Elements per program: enough to stream, few enough registers. Not tuned on hardware yet.
ELEMENTS_PER_PROGRAM = 2048


@triton.jit
def _fwht(x, ROWS: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    for _ in tl.static_range(STAGES):
        a, b = tl.split(tl.reshape(x, (ROWS, DP // BLOCK, BLOCK // 2, 2)))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, DP))
    return x


@triton.jit
def _fp16_floor(v):
    h = v.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True).to(tl.int32)
    below = tl.where(bits < 0, bits + 1, tl.where(bits == 0, -32767, bits - 1))
    bits = tl.where(h.to(tl.float32) > v, below, bits)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _fp16_ceil(v):
    h = v.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True).to(tl.int32)
    bits = tl.where(h.to(tl.float32) < v, bits + 1, bits)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, n_rows, D: tl.constexpr, DP: tl.constexpr,
                     BLOCK: tl.constexpr, STAGES: tl.constexpr, ROWS: tl.constexpr,
                     FORWARD: tl.constexpr, QMAX: tl.constexpr, FMAX: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < n_rows
    cols = tl.arange(0, DP)
    col_ok = cols < D
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    y = _fwht(x, ROWS, DP, BLOCK, STAGES) * FORWARD
    lo = tl.min(tl.where(col_ok[None, :], y, float("inf")), axis=1)
    hi = tl.max(tl.where(col_ok[None, :], y, float("-inf")), axis=1)
    lo = tl.where(lo == 0.0, 0.0, lo)
    hi = tl.where(hi == 0.0, 0.0, hi)
    low = _fp16_floor(tl.minimum(tl.maximum(lo, -FMAX), FMAX))
    low32 = low.to(tl.float32)
    scale = _fp16_ceil(tl.minimum(tl.math.div_rn(hi - low32, QMAX), FMAX))
    s = scale.to(tl.float32)
    t = tl.math.div_rn(y - low32[:, None], tl.where(s == 0.0, 1.0, s)[:, None])
    q = tl.minimum(tl.maximum(tl.floor(t + 0.5), 0.0), QMAX).to(tl.int32)
    even, odd = tl.split(tl.reshape(q, (ROWS, DP // 2, 2)))
    pairs = tl.arange(0, DP // 2)
    packed = (even | (odd << 4)).to(tl.uint8)
    tl.store(codes_ptr + rows[:, None] * (D // 2) + pairs[None, :], packed,
             mask=row_ok[:, None] & (pairs < D // 2)[None, :])
    tl.store(scales_ptr + 2 * rows, scale, mask=row_ok)
    tl.store(scales_ptr + 2 * rows + 1, low, mask=row_ok)


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, out_ptr, n_rows, D: tl.constexpr, DP: tl.constexpr,
                       BLOCK: tl.constexpr, STAGES: tl.constexpr, ROWS: tl.constexpr,
                       INVERSE: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < n_rows
    pairs = tl.arange(0, DP // 2)
    packed = tl.load(codes_ptr + rows[:, None] * (D // 2) + pairs[None, :],
                     mask=row_ok[:, None] & (pairs < D // 2)[None, :], other=0).to(tl.int32)
    q = tl.reshape(tl.join(packed & 0xF, packed >> 4), (ROWS, DP)).to(tl.float32)
    s = tl.load(scales_ptr + 2 * rows, mask=row_ok, other=0.0).to(tl.float32)
    m = tl.load(scales_ptr + 2 * rows + 1, mask=row_ok, other=0.0).to(tl.float32)
    x = _fwht(q * s[:, None] + m[:, None], ROWS, DP, BLOCK, STAGES) * INVERSE
    cols = tl.arange(0, DP)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], to_output(x, out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols < D)[None, :])


def _geometry(d: int, block: int) -> dict:
    padded = triton.next_power_of_2(d)
    return dict(D=d, DP=padded, BLOCK=block, STAGES=log2(block),
                ROWS=max(1, ELEMENTS_PER_PROGRAM // padded))


def quantize_int4h_triton(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `quantize_int4h_reference`."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x: dtype must be bfloat16, float16 or float32, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("x: must be contiguous")
    d = x.shape[-1] if x.dim() else 0
    check_block(block, d)
    n_rows = x.numel() // d
    codes = torch.empty(x.numel() // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n_rows, 2, dtype=torch.float16, device=x.device)
    if n_rows:
        geometry = _geometry(d, block)
        grid = (triton.cdiv(n_rows, geometry["ROWS"]),)
        _quantize_kernel[grid](x, codes, scales, n_rows, **geometry,
                               FORWARD=rotation_scales(block)[0], QMAX=float(QMAX),
                               FMAX=FP16_MAX)
    return codes, scales


def dequantize_int4h_triton(codes: torch.Tensor, scales: torch.Tensor, block: int,
                            shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Same contract as `dequantize_int4h_reference`."""
    d = shape[-1] if shape else 0
    check_block(block, d)
    n_rows = check_sizes(codes, scales, shape)
    if not (codes.is_contiguous() and scales.is_contiguous()):
        raise ValueError("codes/scales: must be contiguous")
    out = torch.empty(shape, dtype=dtype, device=codes.device)
    if n_rows:
        geometry = _geometry(d, block)
        grid = (triton.cdiv(n_rows, geometry["ROWS"]),)
        _dequantize_kernel[grid](codes, scales, out, n_rows, **geometry,
                                 INVERSE=rotation_scales(block)[1])
    return out
