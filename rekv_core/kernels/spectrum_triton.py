"""Triton kernels for SpectrumKV's per-token quantizers (the CUDA path).

Bit for bit the contract of `spectrum_reference.py`: the quantize kernels gather the rows (head,
token) of one tier's tokens straight from K or V `[n_kv, S, d]` and write their codes and scales;
the dequantize kernels scatter the restored rows back to the tokens' positions in the output. The
per-row arithmetic is `rounding_triton`'s (`scale_and_codes`, `to_output`), so both codecs round
the same way. Run on the CPU under `TRITON_INTERPRET=1` for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rekv_core.kernels.groupwise_reference import FP16_MAX, check_bits, code_bytes
from rekv_core.kernels.rounding_triton import scale_and_codes, to_output

# 16 rows per program, as the group-wise kernels (a row of d_h = 128 is two of their groups).
# Not tuned on hardware yet.
ROWS_PER_PROGRAM = 16


@triton.jit
def _row_offsets(index_ptr, n_rows, n_tok, seq_len, ROWS: tl.constexpr, D: tl.constexpr):
    """This program's rows (head-major over the tier's tokens) and their source offsets."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    token = tl.load(index_ptr + rows % n_tok, mask=row_ok, other=0).to(tl.int64)
    return rows, row_ok, (rows // n_tok * seq_len + token) * D


@triton.jit
def _quantize_int8_kernel(x_ptr, index_ptr, codes_ptr, scales_ptr, n_rows, n_tok, seq_len,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                          QMAX: tl.constexpr, FMAX: tl.constexpr):
    rows, row_ok, src = _row_offsets(index_ptr, n_rows, n_tok, seq_len, ROWS, D)
    cols = tl.arange(0, BLOCK_D)
    ok = row_ok[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    scale, q = scale_and_codes(x, tl.max(tl.abs(x), axis=1), QMAX, FMAX)
    tl.store(codes_ptr + rows[:, None] * D + cols[None, :], q.to(tl.int8), mask=ok)
    tl.store(scales_ptr + rows, scale, mask=row_ok)


@triton.jit
def _quantize_int4_kernel(x_ptr, index_ptr, codes_ptr, scales_ptr, n_rows, n_tok, seq_len,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                          QMAX: tl.constexpr, FMAX: tl.constexpr):
    rows, row_ok, src = _row_offsets(index_ptr, n_rows, n_tok, seq_len, ROWS, D)
    pairs = tl.arange(0, BLOCK_D // 2)
    ok = row_ok[:, None] & (pairs < D // 2)[None, :]
    even = src[:, None] + 2 * pairs[None, :]
    x_even = tl.load(x_ptr + even, mask=ok, other=0.0).to(tl.float32)
    x_odd = tl.load(x_ptr + even + 1, mask=ok, other=0.0).to(tl.float32)
    absmax = tl.maximum(tl.max(tl.abs(x_even), axis=1), tl.max(tl.abs(x_odd), axis=1))
    scale, q_even = scale_and_codes(x_even, absmax, QMAX, FMAX)
    _, q_odd = scale_and_codes(x_odd, absmax, QMAX, FMAX)
    packed = (q_even.to(tl.int32) + 8) | ((q_odd.to(tl.int32) + 8) << 4)
    tl.store(codes_ptr + rows[:, None] * (D // 2) + pairs[None, :], packed.to(tl.uint8), mask=ok)
    tl.store(scales_ptr + rows, scale, mask=row_ok)


@triton.jit
def _dequantize_int8_kernel(codes_ptr, scales_ptr, index_ptr, out_ptr, n_rows, n_tok, seq_len,
                            D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    rows, row_ok, dst = _row_offsets(index_ptr, n_rows, n_tok, seq_len, ROWS, D)
    cols = tl.arange(0, BLOCK_D)
    ok = row_ok[:, None] & (cols < D)[None, :]
    q = tl.load(codes_ptr + rows[:, None] * D + cols[None, :], mask=ok, other=0).to(tl.float32)
    s = tl.load(scales_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + dst[:, None] + cols[None, :],
             to_output(q * s[:, None], out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequantize_int4_kernel(codes_ptr, scales_ptr, index_ptr, out_ptr, n_rows, n_tok, seq_len,
                            D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    rows, row_ok, dst = _row_offsets(index_ptr, n_rows, n_tok, seq_len, ROWS, D)
    pairs = tl.arange(0, BLOCK_D // 2)
    ok = row_ok[:, None] & (pairs < D // 2)[None, :]
    packed = tl.load(codes_ptr + rows[:, None] * (D // 2) + pairs[None, :], mask=ok,
                     other=0).to(tl.int32)
    s = tl.load(scales_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    low = ((packed & 0xF) - 8).to(tl.float32) * s
    high = ((packed >> 4) - 8).to(tl.float32) * s
    even = dst[:, None] + 2 * pairs[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + even, to_output(low, dtype), mask=ok)
    tl.store(out_ptr + even + 1, to_output(high, dtype), mask=ok)


def _check(x: torch.Tensor, index: torch.Tensor, bits: int, name: str) -> None:
    check_bits(bits)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: dtype must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() != 3 or not x.is_contiguous():
        raise ValueError(f"{name}: must be a contiguous [n_kv, S, d], got shape {tuple(x.shape)}")
    if bits == 4 and x.shape[2] % 2:
        raise ValueError(f"{name}: INT4 packs pairs, head_dim must be even, got {x.shape[2]}")
    if index.dtype != torch.int64 or index.dim() != 1 or not index.is_contiguous():
        raise ValueError("index: must be a contiguous 1-D int64 tensor of token positions")


def _launch_args(x: torch.Tensor, index: torch.Tensor) -> tuple[tuple[int], dict]:
    n_kv, seq_len, d = x.shape
    n_rows = n_kv * index.numel()
    grid = (triton.cdiv(n_rows, ROWS_PER_PROGRAM),)
    return grid, dict(n_rows=n_rows, n_tok=index.numel(), seq_len=seq_len, D=d,
                      BLOCK_D=triton.next_power_of_2(d), ROWS=ROWS_PER_PROGRAM)


def quantize_tokens_triton(x: torch.Tensor, index: torch.Tensor, bits: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `quantize_tokens_reference`."""
    _check(x, index, bits, "x")
    n_rows = x.shape[0] * index.numel()
    codes = torch.empty(code_bytes(n_rows * x.shape[2], bits), dtype=torch.uint8,
                        device=x.device)
    scales = torch.empty(n_rows, dtype=torch.float16, device=x.device)
    if n_rows:
        grid, args = _launch_args(x, index)
        kernel = _quantize_int8_kernel if bits == 8 else _quantize_int4_kernel
        target = codes.view(torch.int8) if bits == 8 else codes
        kernel[grid](x, index, target, scales, **args, QMAX=float(check_bits(bits)),
                     FMAX=FP16_MAX)
    return codes, scales


def dequantize_tokens_triton(codes: torch.Tensor, scales: torch.Tensor, index: torch.Tensor,
                             bits: int, out: torch.Tensor) -> torch.Tensor:
    """Same contract as `dequantize_tokens_reference`."""
    _check(out, index, bits, "out")
    n_rows = out.shape[0] * index.numel()
    if scales.numel() != n_rows or codes.numel() != code_bytes(n_rows * out.shape[2], bits):
        raise ValueError(f"codes/scales: {codes.numel()} code bytes and {scales.numel()} scales "
                         f"do not describe {index.numel()} tokens of {tuple(out.shape)} at "
                         f"{bits} bits")
    if n_rows:
        grid, args = _launch_args(out, index)
        if bits == 8:
            _dequantize_int8_kernel[grid](codes.view(torch.int8), scales, index, out, **args)
        else:
            _dequantize_int4_kernel[grid](codes, scales, index, out, **args)
    return out
