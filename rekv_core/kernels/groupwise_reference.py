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


# Groups per chunk in the reference: 4096 groups (1 MiB of float32) keep the temporaries in cache;
# whole-tensor temporaries made a 16 MiB layer 9x slower per byte than a 6 MiB one on a 2-core EPYC.
CHUNK_GROUPS = 4096
_HALF = torch.tensor(0.5)


def quantize_rows(rows: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax per row: rows `[n, m]` float32 (modified in place) -> (codes int8
    `[n, m]`, scales fp16 `[n]`). A group of 64 here; a (token, head) row for `spectrum`."""
    scales = torch.clamp(rows.abs().amax(dim=1) / qmax, max=FP16_MAX).to(torch.float16)
    s = scales.to(torch.float32)
    y = rows.div_(torch.where(s == 0, torch.ones_like(s), s)[:, None])
    # trunc(y ± 0.5) equals sign(y)·floor(|y| + 0.5) bit for bit: fp32 rounding is symmetric.
    codes = y.add_(torch.copysign(_HALF.to(y.device), y)).trunc_().clamp_(-qmax, qmax)
    return codes.to(torch.int8), scales


def quantize_reference(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, numel divisible by 64) -> (codes uint8 [numel·bits/8], scales fp16 [numel/64])."""
    return quantize_row_blocks(x.reshape(-1, GROUP_SIZE), bits, CHUNK_GROUPS)


def quantize_row_blocks(rows: torch.Tensor, bits: int, chunk_rows: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` over rows `[n, m]` (not modified) `chunk_rows` at a time, packed for the
    wire: (codes uint8 `[n·m·bits/8]`, INT4 two per byte as offset binary, scales fp16 `[n]`)."""
    qmax = check_bits(bits)
    n, per_row = rows.shape[0], rows.shape[1] * bits // 8
    codes = torch.empty(code_bytes(rows.numel(), bits), dtype=torch.uint8, device=rows.device)
    scales = torch.empty(n, dtype=torch.float16, device=rows.device)
    for start in range(0, n, chunk_rows):
        end = min(start + chunk_rows, n)
        q, scales[start:end] = quantize_rows(rows[start:end].to(torch.float32, copy=True), qmax)
        if bits == 4:
            nibbles = q.add_(8).view(torch.uint8).reshape(-1, 2)
            q = nibbles[:, 0] | (nibbles[:, 1] << 4)
        codes[start * per_row:end * per_row] = q.reshape(-1).view(torch.uint8)
    return codes, scales


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Wire codes -> signed integer codes, one int8 per element."""
    check_bits(bits)
    if bits == 8:
        return codes.view(torch.int8)
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=1).reshape(-1)
    return nibbles.view(torch.int8) - 8


def dequantize_reference(codes: torch.Tensor, scales: torch.Tensor, bits: int,
                         shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    check_bits(bits)
    out = torch.empty(shape, dtype=dtype, device=codes.device).reshape(-1, GROUP_SIZE)
    per_group = GROUP_SIZE * bits // 8
    for start in range(0, scales.numel(), CHUNK_GROUPS):
        end = min(start + CHUNK_GROUPS, scales.numel())
        values = unpack_codes(codes[start * per_group:end * per_group], bits)
        values = values.to(torch.float32).reshape(-1, GROUP_SIZE)
        out[start:end] = values.mul_(scales[start:end].to(torch.float32)[:, None])
    return out.reshape(shape)
