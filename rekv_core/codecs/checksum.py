"""Payload checksums that catch corrupted or reordered wire bytes (not an adversary).

Two algorithms, named in each encoded layer's header so the receiver verifies with the sender's:
- `crc32` (zlib) for host buffers: several GB/s on one core;
- `wsum64`, a position-weighted 64-bit sum of 32-bit words computed with torch ops, for device
  buffers, so a GPU payload is checked without a copy to the host. Any single-bit flip changes it,
  and so does swapping two unequal words.
"""

from __future__ import annotations

import zlib

import torch

ALGORITHMS = ("crc32", "wsum64")
_WEIGHT_MODULUS = 65521


def default_algorithm(device: torch.device) -> str:
    return "crc32" if device.type == "cpu" else "wsum64"


def checksum(buffer: torch.Tensor, algorithm: str) -> int:
    """Checksum of a 1-D uint8 tensor."""
    if algorithm == "crc32":
        data = buffer.detach().cpu().contiguous().numpy()
        return zlib.crc32(memoryview(data))
    if algorithm == "wsum64":
        flat = buffer.detach().contiguous()
        pad = (-flat.numel()) % 4
        if pad:
            flat = torch.cat((flat, flat.new_zeros(pad)))
        words = flat.view(torch.int32).to(torch.int64)
        weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64)
        weights = weights % _WEIGHT_MODULUS + 1
        total = int((words * weights).sum()) + buffer.numel()
        return total & 0xFFFFFFFFFFFFFFFF
    raise ValueError(f"checksum algorithm: must be one of {ALGORITHMS}, got {algorithm!r}")
