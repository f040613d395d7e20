"""PyTorch reference of Hadamard-rotated, token-wise asymmetric INT4 quantization (the CPU path).

Contract, shared bit for bit with the Triton kernels in `hadamard_triton.py`. The input is a tensor
whose last dimension (head_dim, `d`, even) holds rows; each row is one (head, token).

Rotation. H_B is the Sylvester Hadamard matrix of order B (a power of two dividing d, `block`);
the rotation acts on each run of B consecutive elements of a row (block-diagonal). `block=1` is the
identity. The unnormalized transform x -> x·H_B is computed in float32 by Good's constant-geometry
factorization H_B = M^L (L = log2 B): L identical stages, each mapping the pairs
(x[2i], x[2i+1]) of a block to x[2i] + x[2i+1] at position i and x[2i] − x[2i+1] at B/2 + i. Only
IEEE additions, in a fixed order, so any two implementations agree to the bit (a matmul's summation
order would not). The wire domain is y = 2^-⌈L/2⌉ · x·H_B, which is x·(H_B/√B) — the orthonormal
rotation — for even L and that times 1/√2 for odd L: scaling by a power of two is exact, so it is
immune to fused multiply-adds, and the asymmetric quantizer below is scale-invariant (up to the
FP16 rounding of its scale and min). The inverse is x = 2^-⌊L/2⌋ · y·H_B (H_B·H_B = B·I).

Quantization, per row of y (all d elements): lo, hi = min, max (a zero of either sign counts as
+0); `min` = lo clamped to ±65504 and rounded *down* to FP16; `scale` = min((hi − min)/15, 65504)
(float32 IEEE division) rounded *up* to FP16. The directed roundings keep every code in range, so
|y − y'| ≤ scale/2 holds up to float32 rounding for every row inside the FP16 range (rows beyond
it are clamped). code = min(floor((y − min)/scale + 0.5), 15), clamped at 0 (a zero scale divides
by 1). Inputs must be finite.

Wire layout: codes are unsigned nibbles, two per byte, element 2j of the flattened tensor in the
low nibble and 2j+1 in the high one (pairs never straddle rows since d is even); `scales` is FP16
`[rows, 2]`, (scale, min) per row. Dequantization: y' = fp32(code)·fp32(scale) + fp32(min) (the
product is exact: 4-bit code times 11-bit mantissa), then the inverse rotation, then rounding to
the output dtype (nearest-even).
"""

from __future__ import annotations

import torch

QMAX = 15
FP16_MAX = 65504.0
# Elements per chunk in the reference: 256 Ki float32 (1 MiB) keep the temporaries in cache.
CHUNK_ELEMENTS = 1 << 18


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def default_block(head_dim: int) -> int:
    """head_dim if it is a power of two, else the largest power of two dividing it."""
    if head_dim <= 0:
        raise ValueError(f"head_dim: must be positive, got {head_dim}")
    return head_dim & -head_dim


def check_block(block: int, head_dim: int) -> int:
    """Raise `ValueError` naming what is wrong with a rotation block for rows of `head_dim`."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim: int4h needs a positive even head_dim, got {head_dim}")
    if isinstance(block, bool) or not isinstance(block, int) or not is_power_of_two(block):
        raise ValueError(f"block: must be a power of two, got {block!r}")
    if head_dim % block:
        raise ValueError(f"block: {block} does not divide head_dim {head_dim}")
    return block


def log2(block: int) -> int:
    return block.bit_length() - 1


def rotation_scales(block: int) -> tuple[float, float]:
    """(forward, inverse) powers of two applied after the unnormalized transform."""
    stages = log2(block)
    return 2.0 ** -((stages + 1) // 2), 2.0 ** -(stages // 2)


def hadamard_matrix(block: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix H_B / √B (symmetric, H·Hᵀ = I)."""
    if not is_power_of_two(block):
        raise ValueError(f"block: must be a power of two, got {block!r}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / block ** 0.5).to(dtype)


def block_hadamard(head_dim: int, block: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The block-diagonal orthonormal rotation `[head_dim, head_dim]`."""
    check_block(block, head_dim)
    return torch.block_diag(*[hadamard_matrix(block, dtype)] * (head_dim // block))


def fwht(rows: torch.Tensor, block: int) -> torch.Tensor:
    """Unnormalized x·H_B per block of the last dimension of contiguous float32 `[n, d]`, in the
    contract's stage order. `rows` is used as scratch: its contents are lost."""
    n, d = rows.shape
    other = torch.empty_like(rows) if block > 1 else rows
    for _ in range(log2(block)):
        pairs = rows.view(n, d // block, block // 2, 2)
        out = other.view(n, d // block, 2, block // 2)
        torch.add(pairs[..., 0], pairs[..., 1], out=out[:, :, 0])
        torch.sub(pairs[..., 0], pairs[..., 1], out=out[:, :, 1])
        rows, other = other, rows
    return rows


def rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """The wire-domain rotation y = 2^-⌈L/2⌉·x·H_B of `[..., d]`, in float32."""
    check_block(block, x.shape[-1])
    rows = x.to(torch.float32, copy=True).reshape(-1, x.shape[-1])
    return (fwht(rows, block) * rotation_scales(block)[0]).reshape(x.shape)


def unrotate(y: torch.Tensor, block: int) -> torch.Tensor:
    """The inverse of `rotate`, in float32."""
    check_block(block, y.shape[-1])
    rows = y.to(torch.float32, copy=True).reshape(-1, y.shape[-1])
    return (fwht(rows, block) * rotation_scales(block)[1]).reshape(y.shape)


def _fp16_step(h: torch.Tensor, down: bool) -> torch.Tensor:
    """The FP16 neighbour of `h` toward −inf (down) or +inf (up, for h ≥ +0 only)."""
    bits = h.view(torch.int16)
    if not down:
        return (bits + 1).view(torch.float16)
    below = torch.where(bits < 0, bits + 1, torch.where(bits == 0, -32767, bits - 1))
    return below.to(torch.int16).view(torch.float16)


def fp16_floor(v: torch.Tensor) -> torch.Tensor:
    """float32 in [−65504, 65504] -> the largest FP16 value ≤ v."""
    h = v.to(torch.float16)
    return torch.where(h.to(torch.float32) > v, _fp16_step(h, down=True), h)


def fp16_ceil(v: torch.Tensor) -> torch.Tensor:
    """float32 in [0, 65504] -> the smallest FP16 value ≥ v."""
    h = v.to(torch.float16)
    return torch.where(h.to(torch.float32) < v, _fp16_step(h, down=False), h)


def _quantize_rows(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated rows float32 `[n, d]` (modified in place) -> (codes uint8 `[n, d]`, scales fp16
    `[n, 2]`)."""
    lo, hi = y.amin(dim=1), y.amax(dim=1)
    lo = torch.where(lo == 0, 0.0, lo)
    hi = torch.where(hi == 0, 0.0, hi)
    low = fp16_floor(lo.clamp(-FP16_MAX, FP16_MAX))
    low32 = low.to(torch.float32)
    scale = fp16_ceil(((hi - low32) / QMAX).clamp(max=FP16_MAX))
    s = scale.to(torch.float32)
    y.sub_(low32[:, None]).div_(torch.where(s == 0, torch.ones_like(s), s)[:, None])
    codes = y.add_(0.5).floor_().clamp_(0, QMAX).to(torch.uint8)
    return codes, torch.stack((scale, low), dim=1)


def _chunk_rows(d: int) -> int:
    return max(1, CHUNK_ELEMENTS // d)


def quantize_int4h_reference(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., d]` -> (codes uint8 `[numel/2]`, scales fp16 `[numel/d, 2]`)."""
    d = x.shape[-1] if x.dim() else 0
    check_block(block, d)
    flat = x.reshape(-1, d)
    n = flat.shape[0]
    forward = rotation_scales(block)[0]
    codes = torch.empty(x.numel() // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n, 2, dtype=torch.float16, device=x.device)
    step = _chunk_rows(d)
    for start in range(0, n, step):
        end = min(start + step, n)
        y = fwht(flat[start:end].to(torch.float32, copy=True), block).mul_(forward)
        q, scales[start:end] = _quantize_rows(y)
        pairs = q.reshape(-1, 2)
        codes[start * d // 2:end * d // 2] = pairs[:, 0] | (pairs[:, 1] << 4)
    return codes, scales


def unpack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes `[m]` -> one uint8 code per element `[2m]`, in element order."""
    return torch.stack((codes & 0xF, codes >> 4), dim=1).reshape(-1)


def check_sizes(codes: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...]) -> int:
    """Raise `ValueError` unless codes and scales describe `shape`; return its row count."""
    numel = 1
    for n in shape:
        numel *= n
    d = shape[-1] if shape else 0
    rows = numel // d if d else 0
    if codes.numel() * 2 != numel or scales.numel() != 2 * rows:
        raise ValueError(f"codes/scales: {codes.numel()} code bytes and {scales.numel()} scale "
                         f"values do not describe shape {tuple(shape)}")
    return rows


def dequantize_int4h_reference(codes: torch.Tensor, scales: torch.Tensor, block: int,
                               shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    d = shape[-1] if shape else 0
    check_block(block, d)
    n = check_sizes(codes, scales, shape)
    inverse = rotation_scales(block)[1]
    params = scales.reshape(n, 2).to(torch.float32)
    out = torch.empty(shape, dtype=dtype, device=codes.device).reshape(n, d)
    step = _chunk_rows(d)
    for start in range(0, n, step):
        end = min(start + step, n)
        q = unpack_nibbles(codes[start * d // 2:end * d // 2]).to(torch.float32).reshape(-1, d)
        y = q.mul_(params[start:end, 0:1]).add_(params[start:end, 1:2])
        out[start:end] = fwht(y, block).mul_(inverse)
    return out.reshape(shape)
