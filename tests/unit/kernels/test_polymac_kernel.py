"""The `poly61` keyed hash: its PyTorch reference against a straightforward big-integer Horner
evaluation of the contract, and the Triton kernel against the reference (interpreter mode on the
CPU), at odd lengths, offsets, extreme words and keys, and across the block tree's levels."""

import pytest
import torch

from rekv_core.kernels import poly61_many
from rekv_core.kernels.polymac_reference import BLOCK, P61, Poly61Key, poly61_reference
from rekv_core.kernels.polymac_triton import poly61_triton_many

KEYS = [1, 2, P61 - 1, 0x1234_5678_9ABC_DEF % P61]
# 0 and 1 to 5 bytes, one block's edge, and 4·512² + 12 bytes: three levels of the tree
LENGTHS = [0, 1, 3, 4, 5, 4 * BLOCK - 1, 4 * BLOCK, 4 * BLOCK + 1, 4 * BLOCK * BLOCK + 12]


def big_int_poly61(data: bytes, r: int) -> int:
    """The contract as written: (r · Σ w_i r^i + n) mod p, by Horner in Python integers."""
    n = len(data)
    data += bytes(-n % 4)
    q = 0
    for i in reversed(range(len(data) // 4)):
        q = (q * r + int.from_bytes(data[4 * i:4 * i + 4], "little")) % P61
    return (r * q + n) % P61


def _fill(n: int, kind: str, seed: int = 0) -> torch.Tensor:
    if kind == "ff":  # every word 2^32 - 1, every table limb at its largest product
        return torch.full((n,), 0xFF, dtype=torch.uint8)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)


@pytest.mark.parametrize("r", KEYS)
@pytest.mark.parametrize("n", LENGTHS[:-1])
@pytest.mark.parametrize("kind", ["random", "ff"])
def test_the_reference_equals_the_big_integer_contract(r, n, kind):
    buffer = _fill(n, kind, seed=n)
    assert poly61_reference(buffer, Poly61Key(r)) == big_int_poly61(bytes(buffer.tolist()), r)


@pytest.mark.parametrize("kind", ["random", "ff"])
def test_the_reference_equals_the_contract_across_three_levels(kind):
    buffer = _fill(LENGTHS[-1], kind)
    r = KEYS[-1]
    assert poly61_reference(buffer, Poly61Key(r)) == big_int_poly61(bytes(buffer.tolist()), r)


@pytest.mark.parametrize("r", KEYS)
def test_triton_equals_the_reference(r):
    key = Poly61Key(r)
    buffers = [_fill(n, kind, seed=n) for n in LENGTHS[:-1] for kind in ("random", "ff")]
    want = [poly61_reference(b, key) for b in buffers]
    assert poly61_many(buffers, key, backend="triton") == want
    assert poly61_many(buffers, key, backend="torch") == want


def test_triton_equals_the_reference_across_three_levels():
    key = Poly61Key(KEYS[-1])
    buffers = [_fill(LENGTHS[-1], kind) for kind in ("random", "ff")]
    assert poly61_triton_many(buffers, key) == [poly61_reference(b, key) for b in buffers]


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_the_work_split_never_changes_the_value(rows):
    key = Poly61Key(KEYS[-1])
    buffers = [_fill(n, "random", seed=n) for n in (4 * BLOCK * 9 + 3, 4 * BLOCK * 70)]
    assert poly61_triton_many(buffers, key, rows=rows) == [poly61_reference(b, key)
                                                           for b in buffers]


@pytest.mark.parametrize("offset", [1, 2, 3, 4])
def test_slices_at_any_offset(offset):
    """A slice off a 4-byte boundary takes the kernel's byte path; its value is the bytes'."""
    key = Poly61Key(KEYS[-1])
    buffer = _fill(5000 + offset, "random", seed=offset)[offset:]
    want = poly61_reference(buffer.clone(), key)
    assert poly61_reference(buffer, key) == want
    assert poly61_triton_many([buffer], key) == [want]


def test_zero_padding_and_length_are_told_apart():
    """The same words with one more zero byte, and another key, give other values."""
    key = Poly61Key(KEYS[-1])
    buffer = _fill(4 * BLOCK + 3, "random")
    padded = torch.cat((buffer, buffer.new_zeros(1)))
    assert poly61_reference(buffer, key) != poly61_reference(padded, key)
    assert poly61_reference(buffer, key) != poly61_reference(buffer, Poly61Key(KEYS[-1] + 1))


@pytest.mark.parametrize("r", [0, P61, -1])
def test_a_point_outside_the_field_is_refused(r):
    with pytest.raises(ValueError, match="r: "):
        Poly61Key(r)


def test_the_kernel_refuses_a_non_contiguous_buffer():
    with pytest.raises(ValueError, match="contiguous"):
        poly61_triton_many([_fill(64, "random")[::2]], Poly61Key(3))
