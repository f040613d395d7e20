"""Triton kernel for `poly61`, the keyed polynomial hash over a device buffer (the CUDA path).

Exactly the contract and the block tree of `polymac_reference.py`: each program takes `ROWS`
blocks of `BLOCK` items as one [ROWS, BLOCK] tile, loads the level's table of limbs once, and
writes each block's partial; the same kernel then hashes the partials (`WIDE`: 61-bit items split
as lo + 2^32 · hi) until one value is left. Level 0 loads int32 words when the buffer is 4-byte
aligned and a multiple of 4 long, otherwise assembles each word from its bytes (the bytes past
the end read as the zero padding). The root comes back to the host once for all of a message's
buffers, where r · root + n is taken (`Poly61Key.finish`). Run on the CPU under
`TRITON_INTERPRET=1` for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rekv_core.kernels.checksum_reference import check_buffer
from rekv_core.kernels.polymac_reference import (BLOCK, LIMB_BITS, LIMBS, MAX_LEVELS, P61,
                                                  Poly61Key)

# Level 0: 4 blocks (8 KiB) per program, the table's 12 KiB of limbs loaded once for them.
# Not tuned on hardware yet.
ROWS = 4
_ALIGNED, _BYTES, _WIDE = 0, 1, 2


@triton.jit
def _reduce(x, p):
    x = (x & p) + (x >> 61)
    return tl.where(x >= p, x - p, x)


@triton.jit
def _rotate(v, BITS: tl.constexpr):
    low = tl.full((), (1 << (61 - BITS)) - 1, tl.int64)
    return ((v & low) << BITS) | (v >> (61 - BITS))


@triton.jit
def _poly61_kernel(src_ptr, out_ptr, table_ptr, n_items, n_bytes, n_blocks,
                   BLOCK: tl.constexpr, ROWS: tl.constexpr, MODE: tl.constexpr,
                   LIMB: tl.constexpr):
    p = tl.full((), 2305843009213693951, tl.int64)  # 2^61 - 1
    low32 = tl.full((), 4294967295, tl.int64)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    idx = rows[:, None] * BLOCK + cols[None, :]  # int64: past 2^31 items for large buffers
    inside = idx < n_items
    t0 = tl.load(table_ptr + cols)[None, :]
    t1 = tl.load(table_ptr + BLOCK + cols)[None, :]
    t2 = tl.load(table_ptr + 2 * BLOCK + cols)[None, :]
    if MODE == 2:  # partials of the level below: lo · x^k + hi · 2^32 x^k
        v = tl.load(src_ptr + idx, mask=inside, other=0)
        lo = v & low32
        hi = v >> 32
        h0 = tl.load(table_ptr + 3 * BLOCK + cols)[None, :]
        h1 = tl.load(table_ptr + 4 * BLOCK + cols)[None, :]
        h2 = tl.load(table_ptr + 5 * BLOCK + cols)[None, :]
        s0 = tl.sum(lo * t0 + hi * h0, axis=1)
        s1 = tl.sum(lo * t1 + hi * h1, axis=1)
        s2 = tl.sum(lo * t2 + hi * h2, axis=1)
    else:
        if MODE == 0:  # src is the buffer viewed as int32 words
            w = tl.load(src_ptr + idx, mask=inside, other=0).to(tl.int64) & low32
        else:  # src is the uint8 buffer: each word from its 4 bytes, little-endian
            at = idx * 4
            w = tl.load(src_ptr + at, mask=at < n_bytes, other=0).to(tl.int64)
            w |= tl.load(src_ptr + at + 1, mask=at + 1 < n_bytes, other=0).to(tl.int64) << 8
            w |= tl.load(src_ptr + at + 2, mask=at + 2 < n_bytes, other=0).to(tl.int64) << 16
            w |= tl.load(src_ptr + at + 3, mask=at + 3 < n_bytes, other=0).to(tl.int64) << 24
        s0 = tl.sum(w * t0, axis=1)
        s1 = tl.sum(w * t1, axis=1)
        s2 = tl.sum(w * t2, axis=1)
    total = (_reduce(s0, p) + _rotate(_reduce(s1, p), LIMB)
             + _rotate(_reduce(s2, p), 2 * LIMB))
    tl.store(out_ptr + rows, _reduce(total, p), mask=rows < n_blocks)


def _launch(src: torch.Tensor, table: torch.Tensor, n_items: int, n_bytes: int, mode: int,
            rows: int) -> torch.Tensor:
    n_blocks = triton.cdiv(n_items, BLOCK)
    out = torch.empty(n_blocks, dtype=torch.int64, device=src.device)
    _poly61_kernel[(triton.cdiv(n_blocks, rows),)](
        src, out, table, n_items, n_bytes, n_blocks, BLOCK=BLOCK, ROWS=rows, MODE=mode,
        LIMB=LIMB_BITS)
    return out


def root_triton(buffer: torch.Tensor, key: Poly61Key, rows: int = ROWS) -> torch.Tensor:
    """Σ w_i r^i mod p of a non-empty contiguous 1-D uint8 tensor, as an int64 device scalar,
    without waiting for the device. `rows` (blocks per program) changes only the work split."""
    tables = key.tables(buffer.device)
    n_bytes = buffer.numel()
    n_words = triton.cdiv(n_bytes, 4)
    aligned = n_bytes % 4 == 0 and buffer.storage_offset() % 4 == 0 and buffer.data_ptr() % 4 == 0
    src = buffer.detach().view(torch.int32) if aligned else buffer.detach()
    items = _launch(src, tables[0], n_words, n_bytes, _ALIGNED if aligned else _BYTES, rows)
    for level in range(1, MAX_LEVELS):
        if items.numel() == 1:
            break
        items = _launch(items, tables[level], items.numel(), 0, _WIDE, 1)
    return items[0]


def poly61_triton_many(buffers: list[torch.Tensor], key: Poly61Key, rows: int = ROWS
                       ) -> list[int]:
    """`poly61_reference` of each buffer (contiguous 1-D uint8), with one wait for the device."""
    for buffer in buffers:
        check_buffer(buffer, contiguous=True)
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"rows: must be a power of two, got {rows}")
    roots = [root_triton(b, key, rows) for b in buffers if b.numel()]
    found = iter(torch.stack(roots).tolist() if roots else [])
    return [key.finish(next(found) if b.numel() else 0, b.numel()) for b in buffers]


assert LIMBS == 3 and P61 == 2305843009213693951  # the kernel spells both out
