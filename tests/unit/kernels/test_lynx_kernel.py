"""Lynx's streams of INT8 codes: every byte value splits and merges back bit for bit, the anchor-only
code is the middle of the anchor's sixteen, and the Triton kernels (interpreter mode on the CPU)
equal the reference."""

import pytest
import torch

from rekv_core.kernels import lynx_anchor_codes, lynx_merge, lynx_split
from rekv_core.kernels.lynx_reference import (anchor_codes_reference, merge_reference,
                                              split_reference)
from rekv_core.kernels.lynx_triton import BLOCK, merge_triton, split_triton

EVERY_BYTE = torch.arange(256, dtype=torch.uint8)


def _random(n, seed=0):
    return torch.randint(0, 256, (n,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def test_every_byte_splits_into_its_nibbles_and_merges_back():
    codes = torch.cat([EVERY_BYTE, EVERY_BYTE.flip(0)])
    anchor, residual = split_reference(codes)
    assert anchor.numel() == residual.numel() == codes.numel() // 2
    assert torch.equal(merge_reference(anchor, residual), codes)
    q = codes.view(torch.int8).to(torch.int32)
    a = torch.stack((anchor & 0xF, anchor >> 4), 1).reshape(-1).to(torch.int32)
    r = torch.stack((residual & 0xF, residual >> 4), 1).reshape(-1).to(torch.int32)
    signed_a = a - 16 * (a >= 8)
    assert torch.equal(16 * signed_a + r, q)  # a = floor(q / 16), r = q - 16a
    approx = anchor_codes_reference(anchor).view(torch.int8).to(torch.int32)
    assert torch.equal(approx, 16 * signed_a + 8)
    assert (approx - q).abs().max() == 8


@pytest.mark.parametrize("n", [2, 2 * BLOCK, 2 * BLOCK + 2, 6 * BLOCK + 130])
def test_the_triton_kernels_equal_the_reference(n):
    codes = _random(n, seed=n)
    anchor, residual = split_triton(codes)
    want = split_reference(codes)
    assert torch.equal(anchor, want[0]) and torch.equal(residual, want[1])
    assert torch.equal(merge_triton(anchor, residual), codes)
    assert torch.equal(merge_triton(anchor, None), anchor_codes_reference(anchor))
    assert torch.equal(lynx_merge(*lynx_split(codes, "triton"), "torch"), codes)
    assert torch.equal(lynx_anchor_codes(anchor, "triton"), lynx_anchor_codes(anchor, "torch"))


def test_bad_streams_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="codes"):
        lynx_split(_random(3))
    with pytest.raises(ValueError, match="anchor/residual"):
        lynx_merge(_random(4), _random(6))
    with pytest.raises(ValueError, match="anchor/residual"):
        lynx_merge(_random(4).view(torch.int8), _random(4), "triton")
