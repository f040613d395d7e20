"""Triton kernel for the `wsum64` payload checksum (the CUDA path).

Exactly the contract of `checksum_reference.py`. One kernel reads the bytes once: each program
takes a block of 32-bit words (int32 loads when the buffer is 4-byte aligned and a multiple of 4
long, otherwise a [words, 4] tile of bytes assembled little-endian, the bytes past the end read as
the zero padding), weights them by their global word index and reduces them into one int64 partial.
The partials are summed by torch (wrapping int64), and the byte count is added and the result
masked to 64 bits in Python. Run on the CPU under `TRITON_INTERPRET=1` for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rekv_core.kernels.checksum_reference import MASK64, WEIGHT_MODULUS, check_buffer

# 4096 words (16 KiB) per program: enough bytes per program to stream while one program's registers
# stay small. Its int64 partial cannot overflow (4096 · 2^31 · 65521 < 2^63), and the partials'
# sum wraps mod 2^64 like the reference's. Not tuned on hardware yet.
WORDS_PER_PROGRAM = 4096


@triton.jit
def _wsum64_kernel(src_ptr, partials_ptr, n_words, n_bytes, BLOCK: tl.constexpr,
                   WORDS: tl.constexpr, MODULUS: tl.constexpr):
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * BLOCK  # int64: byte offsets of buffers over 2 GiB exceed int32
    lanes = tl.arange(0, BLOCK)
    idx = first + lanes
    if WORDS:  # src is the buffer viewed as int32 words
        words = tl.load(src_ptr + idx, mask=idx < n_words, other=0)
    else:  # src is the uint8 buffer: assemble each word from its 4 bytes, little-endian
        col = tl.arange(0, 4)
        offs = idx[:, None] * 4 + col[None, :]
        raw = tl.load(src_ptr + offs, mask=offs < n_bytes, other=0)
        low = raw.to(tl.int32)
        high = raw.to(tl.int8, bitcast=True).to(tl.int32)  # the top byte carries the sign
        byte = tl.where(col[None, :] == 3, high, low)
        words = tl.sum(byte << (col[None, :] * 8), axis=1)  # exact: no int32 overflow
    # Global weight (idx % MODULUS) + 1 without a 64-bit modulo per word: one scalar modulo per
    # program, then a single conditional subtraction (needs BLOCK <= MODULUS).
    start = (first % MODULUS).to(tl.int32)
    weight = start + lanes
    weight = tl.where(weight >= MODULUS, weight - MODULUS, weight) + 1
    partial = tl.sum(words.to(tl.int64) * weight.to(tl.int64), axis=0)
    tl.store(partials_ptr + pid, partial)


def _check_block(block_words: int) -> None:
    if block_words < 1 or block_words & (block_words - 1) or block_words > WEIGHT_MODULUS:
        raise ValueError(f"block_words: must be a power of two at most {WEIGHT_MODULUS}, "
                         f"got {block_words}")


def wsum64_triton(buffer: torch.Tensor, *, block_words: int = WORDS_PER_PROGRAM) -> int:
    """Same contract as `wsum64_reference`, for a contiguous 1-D uint8 tensor. `block_words` (words
    per program) changes only the work split, never the value."""
    return wsum64_triton_many([buffer], block_words=block_words)[0]


def wsum64_triton_many(buffers: list[torch.Tensor], *, block_words: int = WORDS_PER_PROGRAM
                       ) -> list[int]:
    """`wsum64_triton` of each buffer, with one wait for the device for all of them (a layer's
    buffers are checked together, not one host round trip each)."""
    for buffer in buffers:
        check_buffer(buffer, contiguous=True)
    _check_block(block_words)
    sums = [_weighted_sum(b, block_words) for b in buffers if b.numel()]
    totals = iter(torch.stack(sums).tolist() if sums else [])
    return [(next(totals) + b.numel()) & MASK64 if b.numel() else 0 for b in buffers]


def _weighted_sum(buffer: torch.Tensor, block_words: int) -> torch.Tensor:
    """Σ wᵢ·weightᵢ of a non-empty buffer as an int64 device scalar (wrapping), without waiting."""
    n_bytes = buffer.numel()
    n_words = triton.cdiv(n_bytes, 4)
    # view(int32) needs a 4-byte storage offset; a misaligned pointer takes the byte path
    aligned = n_bytes % 4 == 0 and buffer.storage_offset() % 4 == 0 and buffer.data_ptr() % 4 == 0
    src = buffer.detach().view(torch.int32) if aligned else buffer.detach()
    n_programs = triton.cdiv(n_words, block_words)
    partials = torch.empty(n_programs, dtype=torch.int64, device=buffer.device)
    _wsum64_kernel[(n_programs,)](src, partials, n_words, n_bytes, BLOCK=block_words,
                                  WORDS=aligned, MODULUS=WEIGHT_MODULUS)
    return partials.sum()
