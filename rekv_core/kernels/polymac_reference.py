"""PyTorch reference of `poly61`, the keyed polynomial hash over a device buffer's bytes.

Contract, shared exactly with the Triton kernel in `polymac_triton.py` (it is part of the wire
format: a receiver without a GPU recomputes a GPU sender's value here):
- p = 2^61 − 1; the key is a point r in [1, p) (`Poly61Key`); the input is a 1-D uint8 tensor of
  n bytes, zero-padded to a multiple of 4 and read as little-endian unsigned 32-bit words
  w_0 … w_{m−1} (m = ceil(n / 4));
- poly61(bytes, r) = (r · Σ_i w_i · r^i + n) mod p, an integer in [0, p).

Forgery bound: two different byte strings of at most m words give two different polynomials in r
of degree at most m (each w_i < 2^32 < p, and the constant term n tells zero padding apart), so
they collide for at most m of the p − 1 keys: with r secret and uniform, a party without the key
makes a buffer of m words verify with probability at most m / (2^61 − 1) per attempt (2^-37 for
a 64 MiB buffer). The value is never sent in clear: the seal feeds it to its HMAC (the PRF that
finalises it per message), so r may serve every message of a handoff.

How it is computed (the same steps in the kernel, so both give the same integer): blocks of
`BLOCK` items, each block's partial Σ_k item_k · x^k mod p against a table of powers of the
level's point x, then the partials hashed again as the next level's items at point x^BLOCK, until
one value is left (a tree of ⌈log_512 m⌉ levels). A level's item is a 32-bit word on level 0 and
a 61-bit partial, taken as lo + 2^32 · hi (lo < 2^32, hi < 2^29), on the others. Each table entry
is split into three 21-bit limbs, so every product is below 2^53 and a block's sum of them below
2^63: exact in int64 without a 128-bit multiply; a limb sum's factor 2^21 or 2^42 is then a
rotation of 61 bits (2^61 ≡ 1 mod p).
"""

from __future__ import annotations

import functools

import torch

P61 = (1 << 61) - 1
BLOCK = 512  # items per block at every level: 512 · (2^53 + 2^50) < 2^63
LIMB_BITS = 21
LIMBS = 3
MAX_LEVELS = 4  # 512^4 words (256 GiB): far past the 2^31 bytes a buffer may hold
LOW32 = 0xFFFFFFFF
_CHUNK_BLOCKS = 2048  # the reference's blocks per step, to bound its temporaries (~25 MiB)


def check_point(r: int) -> None:
    if not 0 < r < P61:
        raise ValueError(f"r: the key point must be in [1, 2^61 - 1), got {r}")


def _powers(x: int) -> torch.Tensor:
    """x^0 … x^(BLOCK−1) mod p (int64)."""
    found, value = [], 1
    for _ in range(BLOCK):
        found.append(value)
        value = value * x % P61
    return torch.tensor(found, dtype=torch.int64)


def _limbs(values: torch.Tensor) -> torch.Tensor:
    return torch.stack([(values >> (LIMB_BITS * limb)) & ((1 << LIMB_BITS) - 1)
                        for limb in range(LIMBS)])


@functools.lru_cache(maxsize=16)
def _tables(r: int) -> torch.Tensor:
    """[MAX_LEVELS, 6, BLOCK] int64: per level, the limbs of x^k (rows 0-2) and of 2^32 · x^k
    (rows 3-5), with x = r on level 0 and x^BLOCK of the level below on the next."""
    levels, x = [], r
    for _ in range(MAX_LEVELS):
        powers = _powers(x)
        levels.append(torch.cat((_limbs(powers), _limbs(rotate61(powers, 32)))))
        x = pow(x, BLOCK, P61)
    return torch.stack(levels)


class Poly61Key:
    """The point r and its power tables, per device (computed once per key, then cached)."""

    def __init__(self, r: int):
        check_point(r)
        self.r = r
        self._on: dict[torch.device, torch.Tensor] = {}

    def tables(self, device: torch.device) -> torch.Tensor:
        if device not in self._on:
            self._on[device] = _tables(self.r).to(device)
        return self._on[device]

    def finish(self, q: int, n_bytes: int) -> int:
        """poly61 from the tree's root value q = Σ w_i r^i mod p."""
        return (self.r * q + n_bytes) % P61


def reduce61(x: torch.Tensor) -> torch.Tensor:
    """x mod p for int64 x in [0, 2^63)."""
    x = (x & P61) + (x >> 61)
    return torch.where(x >= P61, x - P61, x)


def rotate61(v: torch.Tensor, bits: int) -> torch.Tensor:
    """2^bits · v mod p for v in [0, p): a rotation of v's 61 bits."""
    return ((v & ((1 << (61 - bits)) - 1)) << bits) | (v >> (61 - bits))


def combine_limbs(s0: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """(s0 + 2^21 · s1 + 2^42 · s2) mod p, each s in [0, 2^63)."""
    total = reduce61(s0) + rotate61(reduce61(s1), LIMB_BITS) + rotate61(reduce61(s2),
                                                                        2 * LIMB_BITS)
    return reduce61(total)


def words_of(buffer: torch.Tensor) -> torch.Tensor:
    """The buffer's little-endian unsigned 32-bit words (zero-padded) as int64."""
    flat = buffer.detach().contiguous()
    pad = (-flat.numel()) % 4
    if pad or flat.storage_offset() % 4:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return flat.view(torch.int32).to(torch.int64) & LOW32


def _level(items: torch.Tensor, table: torch.Tensor, wide: bool) -> torch.Tensor:
    """One level: every block's partial, in blocks of `_CHUNK_BLOCKS` to bound memory."""
    pad = (-items.numel()) % BLOCK
    blocks = (torch.cat((items, items.new_zeros(pad))) if pad else items).view(-1, BLOCK)
    out = []
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        block = blocks[start:start + _CHUNK_BLOCKS]
        if wide:
            lo, hi = block & LOW32, block >> 32
            sums = [(lo * table[limb] + hi * table[LIMBS + limb]).sum(1) for limb in range(LIMBS)]
        else:
            sums = [(block * table[limb]).sum(1) for limb in range(LIMBS)]
        out.append(combine_limbs(*sums))
    return torch.cat(out)


def root_reference(buffer: torch.Tensor, key: Poly61Key) -> int:
    """Σ w_i r^i mod p over the buffer's words, by the block tree, with torch ops on its device."""
    tables = key.tables(buffer.device)
    items = words_of(buffer)
    if items.numel() == 0:
        return 0
    items = _level(items, tables[0], wide=False)
    for level in range(1, MAX_LEVELS):
        if items.numel() == 1:
            break
        items = _level(items, tables[level], wide=True)
    return int(items[0])


def poly61_reference(buffer: torch.Tensor, key: Poly61Key) -> int:
    """poly61 of a 1-D uint8 tensor (the module's contract)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"buffer: must be a 1-D uint8 tensor, got {buffer.dtype} with shape "
                         f"{tuple(buffer.shape)}")
    return key.finish(root_reference(buffer, key), buffer.numel())
