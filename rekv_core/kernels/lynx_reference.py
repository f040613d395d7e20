"""Lynx's progressive streams over INT8 codes: the PyTorch reference.

Contract (the Triton kernels, `lynx_triton.py`, are held to it bit for bit): INT8 wire codes are
bytes (`groupwise_reference`: the int8 code's two's-complement byte). Each byte c splits into its
anchor nibble c >> 4 (the signed code's top four bits: a = floor(q / 16), in [-8, 7]) and its
residual nibble c & 0xF (r = q − 16a, in [0, 15]). Both streams are packed two nibbles per byte,
element 2j in the low nibble and 2j+1 in the high one, as INT4 codes are: n codes (n even) give
n/2 anchor bytes and n/2 residual bytes.

- `merge` rebuilds every byte as (anchor << 4) | residual: the INT8 codes exactly.
- `anchor_codes` turns the anchor stream alone into INT8 codes 16a + 8 (the middle of the 16 codes
  the anchor leaves open, in [-120, 120]): dequantized with the layer's own scales, each value lies
  within 8 code steps (8 · scale) of the full code's value, since |r − 8| ≤ 8.
"""

from __future__ import annotations

import torch


def check_codes(codes: torch.Tensor) -> None:
    if codes.dtype != torch.uint8 or codes.dim() != 1 or codes.numel() % 2:
        raise ValueError(f"codes: need a 1-D uint8 tensor of even length, got {codes.dtype} "
                         f"{tuple(codes.shape)}")


def _pack(nibbles: torch.Tensor) -> torch.Tensor:
    pairs = nibbles.reshape(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=1).reshape(-1)


def split_reference(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 wire codes `[n]` -> (anchor `[n/2]`, residual `[n/2]`), uint8."""
    check_codes(codes)
    return _pack(codes >> 4), _pack(codes & 0xF)


def check_streams(anchor: torch.Tensor, residual: torch.Tensor | None) -> None:
    """`residual` None: the anchor alone."""
    residual = anchor if residual is None else residual
    if (anchor.shape != residual.shape or anchor.dim() != 1
            or {anchor.dtype, residual.dtype} != {torch.uint8}):
        raise ValueError(f"anchor/residual: need 1-D uint8 streams of one length, got "
                         f"{anchor.dtype} {tuple(anchor.shape)} and {residual.dtype} "
                         f"{tuple(residual.shape)}")


def merge_reference(anchor: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The two streams -> the INT8 wire codes `[2·len]`, uint8."""
    check_streams(anchor, residual)
    return (_unpack(anchor) << 4) | _unpack(residual)


def anchor_codes_reference(anchor: torch.Tensor) -> torch.Tensor:
    """The anchor stream alone -> INT8 wire codes 16a + 8, uint8 `[2·len]`."""
    check_streams(anchor, None)
    nibbles = _unpack(anchor)
    return ((nibbles << 4) | 8).view(torch.uint8)  # the byte of 16a + 8: a's nibble over 0b1000
