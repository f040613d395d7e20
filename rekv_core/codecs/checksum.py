"""Payload checksums that catch corrupted or reordered wire bytes (not an adversary).

Two algorithms, named in each encoded layer's header so the receiver verifies with the sender's:
- `crc32` (zlib) for host buffers: several GB/s on one core;
- `wsum64`, a position-weighted 64-bit sum of 32-bit words computed on the buffer's device (one
  Triton kernel on CUDA, torch ops elsewhere; see `rekv_core.kernels.checksum_reference`), for
  device buffers, so a GPU payload is checked without a copy to the host. Any single-bit flip
  changes it, and so does swapping two unequal words (unless 65521·k words apart).
"""

from __future__ import annotations

import zlib

import torch

from rekv_core.kernels import wsum64, wsum64_many

ALGORITHMS = ("crc32", "wsum64")


def default_algorithm(device: torch.device) -> str:
    return "crc32" if device.type == "cpu" else "wsum64"


def checksum(buffer: torch.Tensor, algorithm: str) -> int:
    """Checksum of a 1-D uint8 tensor."""
    if algorithm == "crc32":
        data = buffer.detach().cpu().contiguous().numpy()
        return zlib.crc32(memoryview(data))
    if algorithm == "wsum64":
        return wsum64(buffer.detach().contiguous())
    raise ValueError(f"checksum algorithm: must be one of {ALGORITHMS}, got {algorithm!r}")


def checksums(buffers: dict[str, torch.Tensor], algorithm: str) -> dict[str, int]:
    """`checksum` of every named buffer; on a device, with one wait for all of them."""
    if algorithm == "wsum64":
        names = list(buffers)
        values = wsum64_many([buffers[n].detach().contiguous() for n in names])
        return dict(zip(names, values))
    return {name: checksum(b, algorithm) for name, b in buffers.items()}


def verify_checksums(buffers: dict[str, torch.Tensor], algorithm: str, expected: dict[str, int],
                     error: type[Exception] = ValueError, prefix: str = "") -> None:
    """Raise `error("<prefix>buffer NAME: checksum mismatch (ALGORITHM)")` for the first buffer
    whose checksum differs from `expected` (an unknown algorithm raises `error` too)."""
    try:
        found = checksums(buffers, algorithm)
    except ValueError as exc:
        raise error(f"{prefix}{exc}") from None
    for name, value in found.items():
        if value != expected[name]:
            raise error(f"{prefix}buffer {name}: checksum mismatch ({algorithm})")
