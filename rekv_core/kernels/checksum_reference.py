"""PyTorch reference of the `wsum64` payload checksum (the CPU path).

Contract, shared exactly with the Triton kernel in `checksum_triton.py` (it is part of the wire
format: a receiver recomputes it and compares with the sender's header):
- the input is a 1-D uint8 tensor of n bytes, zero-padded to a multiple of 4 bytes and read as
  little-endian signed 32-bit words w_0, w_1, ..., w_{m-1} with m = ceil(n / 4);
- word i carries the weight (i % 65521) + 1. A single bit flip changes one word by ±2^k (k < 32),
  i.e. the sum by ±2^k·weight, never 0 mod 2^64 as the weight is below 2^16; swapping two unequal
  words i and j changes it by (w_j − w_i)·(weight_i − weight_j), nonzero unless i ≡ j (mod 65521);
- wsum64 = (Σ w_i · ((i % 65521) + 1) + n) mod 2^64, summed in wrapping int64 arithmetic and
  returned as a Python int in [0, 2^64).

The reference accepts a strided 1-D tensor (it makes a contiguous copy); the Triton kernel requires
a contiguous one.
"""

from __future__ import annotations

import torch

WEIGHT_MODULUS = 65521
MASK64 = 0xFFFFFFFFFFFFFFFF


def check_buffer(buffer: torch.Tensor, contiguous: bool) -> None:
    """ValueError naming `buffer` unless it is a 1-D uint8 tensor (and contiguous, if asked)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"buffer: must be a 1-D uint8 tensor, got {buffer.dtype} with shape "
                         f"{tuple(buffer.shape)}")
    if contiguous and not buffer.is_contiguous():
        raise ValueError(f"buffer: must be contiguous, got stride {buffer.stride()}")


def wsum64_reference(buffer: torch.Tensor) -> int:
    """The `wsum64` checksum of a 1-D uint8 tensor, computed with torch ops on its device."""
    check_buffer(buffer, contiguous=False)
    flat = buffer.detach().contiguous()
    pad = (-flat.numel()) % 4
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    elif flat.storage_offset() % 4:  # a slice at an odd offset cannot be viewed as int32 in place
        flat = flat.clone()
    words = flat.view(torch.int32).to(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64)
    weights = weights % WEIGHT_MODULUS + 1
    total = int((words * weights).sum()) + buffer.numel()
    return total & MASK64
