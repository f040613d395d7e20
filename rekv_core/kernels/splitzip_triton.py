"""Triton kernels for the SplitZip BF16 exponent codec (the CUDA path).

Byte for byte the contract of `splitzip_reference.py` (streams, planar little-endian escape buffer,
escape order). Encode takes two passes over the input:
1. a dense kernel, one program per block of `BLOCK_PAIRS` element pairs, looks each exponent up in
   a 256-entry inverse table and writes the codes and sign+mantissa bytes and the block's escape
   count;
2. torch's cumsum turns the counts into each block's first escape index (an exclusive scan; the
   total, read once by the host, sizes the escape buffer), and a scatter kernel re-reads only the
   blocks that have escapes and writes each escape at its rank (block start + rank within the block
   by `tl.cumsum`), so escapes come out in position order, i.e. by chunk then offset.
The counting blocks are independent of the chunk C, which only splits a position into chunk id and
offset. Decode is a dense kernel (nibbles through the 16-entry table, joined with sign+mantissa)
and an escape kernel that overwrites the exponent bits of each escaped element. The escape buffer
is checked (`unpack_escapes`, in torch) before the kernels run; the escape kernel also masks
positions past n, so it never writes out of bounds. Run on the CPU under `TRITON_INTERPRET=1`
for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rekv_core.kernels import splitzip_reference as ref

# 512 pairs (1024 elements) per program for the dense passes, 1024 escapes per program for the
# escape overwrite: powers of two that keep one program's registers small. Not tuned on hardware.
BLOCK_PAIRS = 512
ESCAPES_PER_PROGRAM = 1024


@triton.jit
def _sign_mantissa(bits):
    return (((bits >> 8) & 0x80) | (bits & 0x7F)).to(tl.uint8)


@triton.jit
def _to_int16(raw):
    """16-bit patterns in int32 (0..0xFFFF) -> int16 with the same bits, without relying on how
    a narrowing cast wraps."""
    return (raw - ((raw & 0x8000) << 1)).to(tl.int16)


@triton.jit
def _encode_dense_kernel(x_ptr, inv_ptr, codes_ptr, sm_ptr, counts_ptr, n,
                         BLOCK_PAIRS: tl.constexpr):
    pid = tl.program_id(0)
    pairs = pid.to(tl.int64) * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    even = 2 * pairs
    odd = even + 1
    ok_even = even < n
    ok_odd = odd < n
    b_even = tl.load(x_ptr + even, mask=ok_even, other=0).to(tl.int32) & 0xFFFF
    b_odd = tl.load(x_ptr + odd, mask=ok_odd, other=0).to(tl.int32) & 0xFFFF
    c_even = tl.load(inv_ptr + ((b_even >> 7) & 0xFF))
    c_odd = tl.load(inv_ptr + ((b_odd >> 7) & 0xFF))
    escaped = (tl.sum(((c_even < 0) & ok_even).to(tl.int32), axis=0)
               + tl.sum(((c_odd < 0) & ok_odd).to(tl.int32), axis=0))
    c_even = tl.where(c_even < 0, 0, c_even)
    c_odd = tl.where((c_odd < 0) | (odd >= n), 0, c_odd)
    tl.store(codes_ptr + pairs, (c_even | (c_odd << 4)).to(tl.uint8), mask=ok_even)
    tl.store(sm_ptr + even, _sign_mantissa(b_even), mask=ok_even)
    tl.store(sm_ptr + odd, _sign_mantissa(b_odd), mask=ok_odd)
    tl.store(counts_ptr + pid, escaped)


@triton.jit
def _scatter_escapes_kernel(x_ptr, inv_ptr, counts_ptr, starts_ptr, esc_ptr, n, n_esc,
                            CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if tl.load(counts_ptr + pid) > 0:
        idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = idx < n
        bits = tl.load(x_ptr + idx, mask=ok, other=0).to(tl.int32) & 0xFFFF
        exp = (bits >> 7) & 0xFF
        escaped = (tl.load(inv_ptr + exp) < 0) & ok
        flag = escaped.to(tl.int32)
        rank = tl.load(starts_ptr + pid) + (tl.cumsum(flag, axis=0) - flag).to(tl.int64)
        chunk_id = idx // CHUNK
        offset = idx % CHUNK
        for b in tl.static_range(4):
            tl.store(esc_ptr + 4 * rank + b, ((chunk_id >> (8 * b)) & 0xFF).to(tl.uint8),
                     mask=escaped)
        for b in tl.static_range(2):
            tl.store(esc_ptr + 4 * n_esc + 2 * rank + b,
                     ((offset >> (8 * b)) & 0xFF).to(tl.uint8), mask=escaped)
        tl.store(esc_ptr + 6 * n_esc + rank, exp.to(tl.uint8), mask=escaped)


@triton.jit
def _decode_dense_kernel(codes_ptr, sm_ptr, lut_ptr, out_ptr, n, BLOCK_PAIRS: tl.constexpr):
    pairs = tl.program_id(0).to(tl.int64) * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    even = 2 * pairs
    odd = even + 1
    ok_even = even < n
    ok_odd = odd < n
    packed = tl.load(codes_ptr + pairs, mask=ok_even, other=0).to(tl.int32)
    e_even = tl.load(lut_ptr + (packed & 0xF))
    e_odd = tl.load(lut_ptr + (packed >> 4))
    m_even = tl.load(sm_ptr + even, mask=ok_even, other=0).to(tl.int32)
    m_odd = tl.load(sm_ptr + odd, mask=ok_odd, other=0).to(tl.int32)
    tl.store(out_ptr + even, _to_int16(((m_even & 0x80) << 8) | (e_even << 7) | (m_even & 0x7F)),
             mask=ok_even)
    tl.store(out_ptr + odd, _to_int16(((m_odd & 0x80) << 8) | (e_odd << 7) | (m_odd & 0x7F)),
             mask=ok_odd)


@triton.jit
def _overwrite_escapes_kernel(esc_ptr, out_ptr, n, n_esc, CHUNK: tl.constexpr,
                              BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = j < n_esc
    chunk_id = tl.zeros([BLOCK], dtype=tl.int64)
    for b in tl.static_range(4):
        chunk_id += tl.load(esc_ptr + 4 * j + b, mask=ok, other=0).to(tl.int64) << (8 * b)
    offset = tl.zeros([BLOCK], dtype=tl.int64)
    for b in tl.static_range(2):
        offset += tl.load(esc_ptr + 4 * n_esc + 2 * j + b, mask=ok, other=0).to(tl.int64) << (8 * b)
    exp = tl.load(esc_ptr + 6 * n_esc + j, mask=ok, other=0).to(tl.int32)
    pos = chunk_id * CHUNK + offset
    ok = ok & (pos < n)
    raw = tl.load(out_ptr + pos, mask=ok, other=0).to(tl.int32) & 0xFFFF
    tl.store(out_ptr + pos, _to_int16((raw & 0x807F) | (exp << 7)), mask=ok)


def encode_triton(x: torch.Tensor, codebook: list[int], chunk: int = ref.DEFAULT_CHUNK
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `encode_reference`; waits for the device once, for the escape count."""
    codebook, chunk = ref.check_codebook(codebook), ref.check_chunk(chunk)
    bits = ref.check_input(x)
    n, device = bits.numel(), bits.device
    codes = torch.empty((n + 1) // 2, dtype=torch.uint8, device=device)
    sm = torch.empty(n, dtype=torch.uint8, device=device)
    if n == 0:
        return codes, sm, torch.empty(0, dtype=torch.uint8, device=device)
    inv = ref.inverse_lut(codebook, device)
    n_blocks = triton.cdiv(n, 2 * BLOCK_PAIRS)
    counts = torch.empty(n_blocks, dtype=torch.int32, device=device)
    _encode_dense_kernel[(n_blocks,)](bits, inv, codes, sm, counts, n, BLOCK_PAIRS=BLOCK_PAIRS)
    ends = torch.cumsum(counts, dim=0, dtype=torch.int64)
    n_esc = int(ends[-1].item())
    escapes = torch.empty(ref.ESCAPE_BYTES * n_esc, dtype=torch.uint8, device=device)
    if n_esc:
        _scatter_escapes_kernel[(n_blocks,)](bits, inv, counts, ends - counts, escapes, n, n_esc,
                                             CHUNK=chunk, BLOCK=2 * BLOCK_PAIRS)
    return codes, sm, escapes


def decode_triton(codes: torch.Tensor, sm: torch.Tensor, escapes: torch.Tensor,
                  codebook: list[int], n: int, chunk: int = ref.DEFAULT_CHUNK) -> torch.Tensor:
    """Same contract as `decode_reference`, the escape buffer checked by `unpack_escapes` first."""
    codebook, chunk = ref.check_codebook(codebook), ref.check_chunk(chunk)
    n_esc = ref.check_streams(codes, sm, escapes, n)
    ref.unpack_escapes(escapes, n, chunk)
    out = torch.empty(n, dtype=torch.int16, device=codes.device)
    if n:
        lut = torch.tensor(codebook, dtype=torch.int32, device=codes.device)
        _decode_dense_kernel[(triton.cdiv(n, 2 * BLOCK_PAIRS),)](
            codes.contiguous(), sm.contiguous(), lut, out, n, BLOCK_PAIRS=BLOCK_PAIRS)
    if n_esc:
        _overwrite_escapes_kernel[(triton.cdiv(n_esc, ESCAPES_PER_PROGRAM),)](
            escapes.contiguous(), out, n, n_esc, CHUNK=chunk, BLOCK=ESCAPES_PER_PROGRAM)
    return out.view(torch.bfloat16)
