"""What a party on the path without the handoff's key can do to bytes whose header holds their
linear checksum: change them and fix the checksum up, as issue 28 did by hand.

- `keep_crc32(original, forged, free_bits)`: CRC32 is affine over GF(2) for a fixed length, so
  XOR-ing a solved subset of 32 (or more) free bit positions restores the original's CRC32.
- `keep_wsum64(forged, i, k, t)`: wsum64 is a weighted sum of signed 32-bit words: word i
  changed by weight_k · t and word k by −weight_i · t leave it unchanged.
Both work on a 1-D uint8 tensor in place and return it.
"""

import zlib

import numpy as np
import torch

from rekv_core.kernels.checksum_reference import WEIGHT_MODULUS


def _crc(data: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(data)))


def _solve_gf2(columns: list[int], target: int) -> int:
    """A mask x of columns whose XOR is `target` (Gaussian elimination over GF(2))."""
    basis: dict[int, tuple[int, int]] = {}  # pivot bit -> (value, combination of columns)
    for index, column in enumerate(columns):
        value, combo = column, 1 << index
        for bit, (v, c) in sorted(basis.items(), reverse=True):
            if value >> bit & 1:
                value, combo = value ^ v, combo ^ c
        if value:
            basis[value.bit_length() - 1] = (value, combo)
    result = 0
    for bit, (v, c) in sorted(basis.items(), reverse=True):
        if target >> bit & 1:
            target, result = target ^ v, result ^ c
    if target:
        raise ValueError("these free bits cannot restore the CRC32")
    return result


def keep_crc32(original: torch.Tensor, forged: torch.Tensor, free_bits: list[int]) -> torch.Tensor:
    """Flip a subset of `free_bits` (bit positions, byte·8 + bit) of `forged` so that its CRC32
    equals `original`'s (same length)."""
    data = forged.numpy()
    zeros = np.zeros_like(data)
    base = _crc(zeros)
    columns = []
    for position in free_bits:
        unit = zeros.copy()
        unit[position // 8] = 1 << (position % 8)
        columns.append(_crc(unit) ^ base)
    choice = _solve_gf2(columns, _crc(original.numpy()) ^ _crc(data))
    for index, position in enumerate(free_bits):
        if choice >> index & 1:
            data[position // 8] ^= 1 << (position % 8)
    return forged


def keep_wsum64(forged: torch.Tensor, i: int, k: int, t: int) -> torch.Tensor:
    """Word i += weight_k · t, word k −= weight_i · t (little-endian int32 words)."""
    words = forged.numpy()[: forged.numel() // 4 * 4].view("<i4")
    weight = [j % WEIGHT_MODULUS + 1 for j in (i, k)]
    new_i, new_k = int(words[i]) + weight[1] * t, int(words[k]) - weight[0] * t
    if not (-2**31 <= new_i < 2**31 and -2**31 <= new_k < 2**31):
        raise ValueError(f"words {i} and {k} cannot take the change {t}")
    words[i], words[k] = new_i, new_k
    return forged
