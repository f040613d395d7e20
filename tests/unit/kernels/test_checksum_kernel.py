"""The `wsum64` Triton kernel against its PyTorch reference (interpreter mode on the CPU), the
checksum's detection properties, and the wire value pinned to the pre-kernel implementation."""

import pytest
import torch

from rekv_core.codecs.checksum import checksum
from rekv_core.kernels import wsum64
from rekv_core.kernels.checksum_reference import wsum64_reference
from rekv_core.kernels.checksum_triton import wsum64_triton

# 300_003 bytes = 75_001 words: 19 programs of 4096 words, past the weight modulus (65521 words),
# with a 3-byte tail.
LENGTHS = [0, 1, 2, 3, 4, 5, 63, 64, 65, 4095, 4096, 4097, 300_003]


def _random(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8)


def _fill(n, kind):
    if kind == "random":
        return _random(n)
    if kind == "ff":  # every word -1
        return torch.full((n,), 0xFF, dtype=torch.uint8)
    return torch.tensor([0, 0, 0, 0x80], dtype=torch.uint8).repeat(n // 4 + 1)[:n]  # -2^31 words


@pytest.mark.parametrize("kind", ["random", "ff", "int_min"])
@pytest.mark.parametrize("n", LENGTHS)
def test_triton_equals_reference(n, kind):
    buf = _fill(n, kind)
    ref = wsum64_reference(buf)
    assert 0 <= ref < 2**64
    assert wsum64_triton(buf) == ref
    assert wsum64(buf, backend="triton") == ref and wsum64(buf, backend="torch") == ref


# (bytes, words per program): few enough programs for the interpreter; 32768 puts the modulus
# (word 65521) inside a block, as the default 4096 does at 300_003 bytes above.
SPLITS = [(3, 1), (65, 1), (257, 1), (65, 8), (4097, 64), (20_003, 256), (70_001 * 4 + 1, 32768)]


@pytest.mark.parametrize("n,block_words", SPLITS)
def test_the_work_split_never_changes_the_value(n, block_words):
    buf = _fill(n, "random")
    assert wsum64_triton(buf, block_words=block_words) == wsum64_reference(buf)


@pytest.mark.parametrize("offset", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [4, 8, 4097, 16_384])
def test_slices_at_any_offset(n, offset):
    """A contiguous slice off a 4-byte boundary takes the byte path; on one it may load words."""
    buf = _random(n + offset, seed=offset)[offset:]
    assert buf.is_contiguous()
    ref = wsum64_reference(buf.clone())
    assert wsum64_reference(buf) == ref
    assert wsum64_triton(buf) == ref


def test_non_contiguous_input_is_rejected_by_the_kernel_and_copied_elsewhere():
    strided = _random(202)[::2]
    assert not strided.is_contiguous()
    with pytest.raises(ValueError, match="buffer: must be contiguous"):
        wsum64_triton(strided)
    expected = wsum64_reference(strided.contiguous())
    assert wsum64_reference(strided) == expected
    assert checksum(strided, "wsum64") == expected  # the codec path makes the buffer contiguous


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_inputs_are_named(backend):
    with pytest.raises(ValueError, match="buffer: must be a 1-D uint8 tensor"):
        wsum64(torch.zeros(8, dtype=torch.int32), backend=backend)
    with pytest.raises(ValueError, match="buffer: must be a 1-D uint8 tensor"):
        wsum64(torch.zeros(2, 4, dtype=torch.uint8), backend=backend)
    with pytest.raises(ValueError, match="backend"):
        wsum64(torch.zeros(8, dtype=torch.uint8), backend="cuda")
    if backend == "triton":
        with pytest.raises(ValueError, match="block_words"):
            wsum64_triton(torch.zeros(8, dtype=torch.uint8), block_words=48)
        with pytest.raises(ValueError, match="block_words"):
            wsum64_triton(torch.zeros(8, dtype=torch.uint8), block_words=65536)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_single_bit_flip_changes_it(backend):
    buf = _random(4097 * 4 + 3)  # the flips below reach the last word, in the 3-byte tail
    reference = wsum64(buf, backend=backend)
    for byte in (0, 3, 7, 4096 * 4 + 3, buf.numel() - 1):
        for bit in range(8):  # bit 7 of byte 3 of a word is its sign bit
            flipped = buf.clone()
            flipped[byte] ^= 1 << bit
            assert wsum64(flipped, backend=backend) != reference, (byte, bit)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_swapping_two_unequal_words_changes_it(backend):
    buf = _random(70_000 * 4)
    words = buf.view(torch.int32)
    reference = wsum64(buf, backend=backend)
    for i, j in ((0, 1), (0, 4096), (100, 65_520), (65_520, 65_522)):
        assert words[i] != words[j]
        swapped = buf.clone()
        swapped.view(torch.int32)[[i, j]] = words[[j, i]]
        assert wsum64(swapped, backend=backend) != reference, (i, j)
    # the documented blind spot: words 65521 apart carry the same weight
    swapped = buf.clone()
    swapped.view(torch.int32)[[3, 3 + 65_521]] = words[[3 + 65_521, 3]]
    assert wsum64(swapped, backend=backend) == reference


def test_the_wire_value_did_not_change():
    """Values computed with the torch-only `checksum(.., "wsum64")` before the Triton kernel."""
    pattern = (torch.arange(1000) % 251).to(torch.uint8)
    known = [(pattern, 18446741138279874269), (pattern[:999], 18446741180222914268),
             (torch.full((300_003,), 0xFF, dtype=torch.uint8), 156856834262),
             (torch.zeros(0, dtype=torch.uint8), 0)]
    for buf, value in known:
        assert checksum(buf, "wsum64") == value
        assert wsum64(buf, backend="torch") == value
        assert wsum64(buf, backend="triton") == value


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_many_buffers_at_once_equal_one_at_a_time(backend):
    from rekv_core.kernels import wsum64_many

    g = torch.Generator().manual_seed(3)
    buffers = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
               for n in (0, 5, 4096, 0, 70_001)]
    assert wsum64_many(buffers, backend) == [wsum64(b, "torch") for b in buffers]
