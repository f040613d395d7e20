"""Quantizer, SplitZip, checksum and MAC kernels, each beside its PyTorch reference.

`quantize_groupwise` / `dequantize_groupwise`, `quantize_tokens` / `dequantize_tokens` (SpectrumKV's
per-token tiers), `splitzip_encode` / `splitzip_decode`, `quantize_int4h` / `dequantize_int4h`
(Hadamard-rotated INT4), `wsum64` and `poly61_many` (the keyed hash behind the seal's MAC over
device buffers) and `decode_attention` (the batched decode step's attention over a slab of caches),
`lynx_split` / `lynx_merge` / `lynx_anchor_codes` (Lynx's anchor and residual streams of INT8 codes)
pick the backend: the Triton kernel for CUDA tensors, the PyTorch reference
otherwise; `backend="triton"` forces the kernel (on the CPU it then needs
`TRITON_INTERPRET=1`), `backend="torch"` forces the reference. Triton is imported only when used.
"""

from __future__ import annotations

import torch

from rekv_core.kernels.checksum_reference import wsum64_reference
from rekv_core.kernels.decode_attention_reference import decode_attention_reference
from rekv_core.kernels.groupwise_reference import (GROUP_SIZE, dequantize_reference,
                                                   quantize_reference)
from rekv_core.kernels.polymac_reference import Poly61Key, poly61_reference
from rekv_core.kernels.lynx_reference import (anchor_codes_reference, merge_reference,
                                               split_reference)
from rekv_core.kernels.hadamard_reference import (dequantize_int4h_reference,
                                                  quantize_int4h_reference)
from rekv_core.kernels.spectrum_reference import (dequantize_tokens_reference,
                                                  quantize_tokens_reference)
from rekv_core.kernels.splitzip_reference import DEFAULT_CHUNK as SPLITZIP_CHUNK
from rekv_core.kernels.splitzip_reference import ExponentHistogram, calibrate_codebook
from rekv_core.kernels.splitzip_reference import decode_reference, encode_reference

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


def quantize_tokens(x: torch.Tensor, index: torch.Tensor, bits: int, backend: str = "auto"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """SpectrumKV: quantize the (head, token) rows of tokens `index` of x `[n_kv, S, d]`
    (contract in `spectrum_reference.py`)."""
    if _use_triton(x.device, backend):
        from rekv_core.kernels.spectrum_triton import quantize_tokens_triton
        return quantize_tokens_triton(x, index, bits)
    return quantize_tokens_reference(x, index, bits)


def dequantize_tokens(codes: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, bits: int,
                      out: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """SpectrumKV: write the restored rows of tokens `index` into out `[n_kv, S, d]`."""
    if _use_triton(out.device, backend):
        from rekv_core.kernels.spectrum_triton import dequantize_tokens_triton
        return dequantize_tokens_triton(codes, scales, index, bits, out)
    return dequantize_tokens_reference(codes, scales, index, bits, out)


def splitzip_encode(x: torch.Tensor, codebook: list[int], chunk: int = SPLITZIP_CHUNK,
                    backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A BF16 tensor (any shape) -> its SplitZip streams (codes, sm, escapes), 1-D uint8 on its
    device (contract in `splitzip_reference.py`)."""
    if _use_triton(x.device, backend):
        from rekv_core.kernels.splitzip_triton import encode_triton
        return encode_triton(x, codebook, chunk)
    return encode_reference(x, codebook, chunk)


def splitzip_decode(codes: torch.Tensor, sm: torch.Tensor, escapes: torch.Tensor,
                    codebook: list[int], n: int, chunk: int = SPLITZIP_CHUNK,
                    backend: str = "auto") -> torch.Tensor:
    """SplitZip streams of n elements -> the 1-D BF16 tensor; `ValueError` naming the stream or
    field that does not fit."""
    if _use_triton(codes.device, backend):
        from rekv_core.kernels.splitzip_triton import decode_triton
        return decode_triton(codes, sm, escapes, codebook, n, chunk)
    return decode_reference(codes, sm, escapes, codebook, n, chunk)


def quantize_int4h(x: torch.Tensor, block: int, backend: str = "auto"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Hadamard-rotated INT4: x `[..., d]` -> (codes uint8 `[numel/2]`, (scale, min) fp16
    `[rows, 2]`); `block=1` skips the rotation (contract in `hadamard_reference.py`)."""
    if _use_triton(x.device, backend):
        from rekv_core.kernels.hadamard_triton import quantize_int4h_triton
        return quantize_int4h_triton(x, block)
    return quantize_int4h_reference(x, block)


def dequantize_int4h(codes: torch.Tensor, scales: torch.Tensor, block: int,
                     shape: tuple[int, ...], dtype: torch.dtype, backend: str = "auto"
                     ) -> torch.Tensor:
    """The inverse of `quantize_int4h`: dequantized and un-rotated, in `dtype`."""
    if _use_triton(codes.device, backend):
        from rekv_core.kernels.hadamard_triton import dequantize_int4h_triton
        return dequantize_int4h_triton(codes, scales, block, shape, dtype)
    return dequantize_int4h_reference(codes, scales, block, shape, dtype)


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


def poly61_many(buffers: list[torch.Tensor], key: Poly61Key, backend: str = "auto") -> list[int]:
    """The keyed `poly61` hash of each 1-D uint8 tensor (contract in `polymac_reference.py`); on
    the Triton path (contiguous buffers, one device) with one wait for the device for all."""
    if buffers and _use_triton(buffers[0].device, backend):
        from rekv_core.kernels.polymac_triton import poly61_triton_many
        return poly61_triton_many(buffers, key)
    return [poly61_reference(b, key) for b in buffers]


def lynx_split(codes: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 wire codes -> (anchor, residual) streams (contract in `lynx_reference.py`)."""
    if _use_triton(codes.device, backend):
        from rekv_core.kernels.lynx_triton import split_triton
        return split_triton(codes)
    return split_reference(codes)


def lynx_merge(anchor: torch.Tensor, residual: torch.Tensor, backend: str = "auto"
               ) -> torch.Tensor:
    """The two streams -> the INT8 wire codes, bit for bit."""
    if _use_triton(anchor.device, backend):
        from rekv_core.kernels.lynx_triton import merge_triton
        return merge_triton(anchor, residual)
    return merge_reference(anchor, residual)


def lynx_anchor_codes(anchor: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """The anchor stream alone -> INT8 wire codes 16a + 8."""
    if _use_triton(anchor.device, backend):
        from rekv_core.kernels.lynx_triton import merge_triton
        return merge_triton(anchor, None)
    return anchor_codes_reference(anchor)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     slots: torch.Tensor, lengths: torch.Tensor, backend: str = "auto"
                     ) -> torch.Tensor:
    """One query per sequence against its slot of a slab of caches, `[B, n_h * d_h]` (contract
    in `decode_attention_reference.py`)."""
    if _use_triton(q.device, backend):
        from rekv_core.kernels.decode_attention_triton import decode_attention_triton
        return decode_attention_triton(q, keys, values, slots, lengths)
    return decode_attention_reference(q, keys, values, slots, lengths)


__all__ = ["BACKENDS", "GROUP_SIZE", "SPLITZIP_CHUNK", "ExponentHistogram", "Poly61Key",
           "calibrate_codebook", "decode_attention", "lynx_anchor_codes", "lynx_merge",
           "lynx_split",
           "dequantize_groupwise", "dequantize_int4h", "dequantize_tokens", "quantize_groupwise",
           "quantize_int4h", "quantize_tokens",
           "poly61_many", "splitzip_decode", "splitzip_encode", "wsum64", "wsum64_many"]
