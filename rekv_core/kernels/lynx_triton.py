"""Triton kernels for Lynx's anchor/residual streams over INT8 codes (the CUDA path).

Exactly the contract of `lynx_reference.py`: each program takes `BLOCK` pairs of code bytes and
writes one anchor byte and one residual byte per pair (`split`), or the reverse (`merge`), or the
anchor-only codes (`anchor_codes`). Bytes are loaded as uint8 and widened to int32 for the shifts.
Run on the CPU under `TRITON_INTERPRET=1` for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rekv_core.kernels.lynx_reference import check_codes, check_streams

BLOCK = 1024  # pairs per program; not tuned on hardware yet


@triton.jit
def _split_kernel(codes_ptr, anchor_ptr, residual_ptr, n_pairs, BLOCK: tl.constexpr):
    pairs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = pairs < n_pairs
    even = tl.load(codes_ptr + 2 * pairs, mask=inside, other=0).to(tl.int32)
    odd = tl.load(codes_ptr + 2 * pairs + 1, mask=inside, other=0).to(tl.int32)
    anchor = (even >> 4) | ((odd >> 4) << 4)
    residual = (even & 15) | ((odd & 15) << 4)
    tl.store(anchor_ptr + pairs, anchor.to(tl.uint8), mask=inside)
    tl.store(residual_ptr + pairs, residual.to(tl.uint8), mask=inside)


@triton.jit
def _merge_kernel(anchor_ptr, residual_ptr, codes_ptr, n_pairs, ANCHOR_ONLY: tl.constexpr,
                  BLOCK: tl.constexpr):
    pairs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = pairs < n_pairs
    a = tl.load(anchor_ptr + pairs, mask=inside, other=0).to(tl.int32)
    if ANCHOR_ONLY:
        low, high = 8, 8
    else:
        r = tl.load(residual_ptr + pairs, mask=inside, other=0).to(tl.int32)
        low, high = r & 15, r >> 4
    tl.store(codes_ptr + 2 * pairs, (((a & 15) << 4) | low).to(tl.uint8), mask=inside)
    tl.store(codes_ptr + 2 * pairs + 1, (((a >> 4) << 4) | high).to(tl.uint8), mask=inside)


def split_triton(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_codes(codes)
    codes = codes.contiguous()
    n_pairs = codes.numel() // 2
    anchor = torch.empty(n_pairs, dtype=torch.uint8, device=codes.device)
    residual = torch.empty_like(anchor)
    _split_kernel[(triton.cdiv(n_pairs, BLOCK),)](codes, anchor, residual, n_pairs, BLOCK=BLOCK)
    return anchor, residual


def merge_triton(anchor: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """`merge`, or with `residual` None the anchor-only codes."""
    check_streams(anchor, residual)
    n_pairs = anchor.numel()
    codes = torch.empty(2 * n_pairs, dtype=torch.uint8, device=anchor.device)
    _merge_kernel[(max(1, triton.cdiv(n_pairs, BLOCK)),)](
        anchor.contiguous(), anchor if residual is None else residual.contiguous(), codes,
        n_pairs, ANCHOR_ONLY=residual is None, BLOCK=BLOCK)
    return codes
