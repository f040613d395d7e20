"""Quantizer and checksum kernels, each beside its PyTorch reference.

`quantize_groupwise` / `dequantize_groupwise` and `wsum64` pick the backend: the Triton kernel for
CUDA tensors, the PyTorch reference otherwise; `backend="triton"` forces the kernel (on the CPU it
then needs `TRITON_INTERPRET=1`), `backend="torch"` forces the reference. Triton is imported only
when used.
"""

from __future__ import annotations

import torch

from rekv_core.kernels.checksum_reference import wsum64_reference
from rekv_core.kernels.groupwise_reference import (GROUP_SIZE, dequantize_reference,
                                                   quantize_reference)

BACKENDS = ("auto", "torch", "triton")


def _use_triton(device: torch.device, backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {BACKENDS}, got {backend!r}")
    return backend == "triton" or (backend == "auto" and device.type == "cuda")


def quantize_groupwise(x: torch.Tensor, bits: int, backend: str = "auto"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(x.device, backend):
        from rekv_core.kernels.groupwise_triton import quantize_triton
        return quantize_triton(x, bits)
    return quantize_reference(x, bits)


def dequantize_groupwise(codes: torch.Tensor, scales: torch.Tensor, bits: int,
                         shape: tuple[int, ...], dtype: torch.dtype, backend: str = "auto"
                         ) -> torch.Tensor:
    if _use_triton(codes.device, backend):
        from rekv_core.kernels.groupwise_triton import dequantize_triton
        return dequantize_triton(codes, scales, bits, shape, dtype)
    return dequantize_reference(codes, scales, bits, shape, dtype)


def wsum64(buffer: torch.Tensor, backend: str = "auto") -> int:
    """The `wsum64` checksum of a 1-D uint8 tensor (contract in `checksum_reference.py`); the Triton
    kernel needs it contiguous."""
    if _use_triton(buffer.device, backend):
        from rekv_core.kernels.checksum_triton import wsum64_triton
        return wsum64_triton(buffer)
    return wsum64_reference(buffer)


def wsum64_many(buffers: list[torch.Tensor], backend: str = "auto") -> list[int]:
    """`wsum64` of each buffer; on the Triton path with one wait for the device for all."""
    if buffers and _use_triton(buffers[0].device, backend):
        from rekv_core.kernels.checksum_triton import wsum64_triton_many
        return wsum64_triton_many(buffers)
    return [wsum64_reference(b) for b in buffers]


__all__ = ["BACKENDS", "GROUP_SIZE", "dequantize_groupwise", "quantize_groupwise", "wsum64",
           "wsum64_many"]
