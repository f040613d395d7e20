"""PyTorch reference of the SplitZip lossless BF16 exponent codec (the CPU path), and calibration.

Contract, shared byte for byte with the Triton kernels in `splitzip_triton.py`. A BF16 element's 16
bits are sign (bit 15), exponent (bits 14..7) and mantissa (bits 6..0). For n elements (the tensor
flattened) and a codebook of 16 distinct exponent values (code k stands for `codebook[k]`):
- `codes`, ⌈n/2⌉ bytes: the 4-bit code of element 2j in the low nibble of byte j, of element 2j+1 in
  the high nibble; an element whose exponent is not in the codebook (an escape) carries code 0, and
  so does the missing high nibble of an odd n;
- `sm`, n bytes: sign << 7 | mantissa of each element;
- `escapes`, 7·n_esc bytes: the escaped elements in increasing position, i.e. ordered by chunk then
  by offset, with position = chunk id · C + offset (C, the chunk, a power of two up to 2^16). The
  buffer is planar: n_esc int32 chunk ids (4·n_esc bytes), then n_esc uint16 offsets within the
  chunk (2·n_esc bytes), then n_esc uint8 raw exponents (n_esc bytes); every integer little-endian.
Decode is a dense pass, raw = (sm & 0x80) << 8 | codebook[code] << 7 | (sm & 0x7F), then each
escape overwrites its element's exponent bits. Every BF16 bit pattern (±0, subnormals, ±inf, NaN
payloads) round-trips bit for bit; the streams total exactly ⌈n/2⌉ + n + 7·n_esc bytes.

Calibration: the codebook is the 16 most frequent exponents of a calibration set, higher count first
and, at equal counts, the smaller exponent value first; fewer than 16 distinct exponents are padded
with the smallest unused ones (count 0, same rule). `ExponentHistogram` accumulates the counts
tensor by tensor, so a pass over many layers holds one at a time.

Validation raises `ValueError` naming the field (`codebook`, `chunk`, `x`, `codes`, `sm`,
`escapes`); the codec layer turns errors about received data into `CorruptPayloadError`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

NUM_CODES = 16
NUM_EXPONENTS = 256
DEFAULT_CHUNK = 1024
MAX_CHUNK = 1 << 16  # offsets within a chunk are uint16
ESCAPE_BYTES = 7  # int32 chunk id + uint16 offset + uint8 exponent
# Elements per step of the reference: 1 Mi elements keep its int32 temporaries to a few MiB each.
REFERENCE_BLOCK = 1 << 20  # even, so a step never splits a byte of codes


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_codebook(codebook) -> list[int]:
    """The codebook as a list of 16 distinct ints in 0..255, or `ValueError` naming `codebook`."""
    values = list(codebook) if isinstance(codebook, (list, tuple)) else None
    if (values is None or len(values) != NUM_CODES or not all(_is_int(e) for e in values)
            or not all(0 <= e < NUM_EXPONENTS for e in values) or len(set(values)) != NUM_CODES):
        raise ValueError(f"codebook: must be {NUM_CODES} distinct ints in 0..{NUM_EXPONENTS - 1}, "
                         f"got {codebook!r}")
    return values


def check_chunk(chunk) -> int:
    if not _is_int(chunk) or chunk < 1 or chunk > MAX_CHUNK or chunk & (chunk - 1):
        raise ValueError(f"chunk: must be a power of two in 1..{MAX_CHUNK}, got {chunk!r}")
    return chunk


def check_input(x: torch.Tensor) -> torch.Tensor:
    """x (BF16, any shape) -> its elements as a contiguous 1-D int16 tensor of bit patterns."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x: dtype must be bfloat16, got {x.dtype}")
    return x.reshape(-1).contiguous().view(torch.int16)


def stream_bytes(n: int, n_escapes: int) -> dict[str, int]:
    """Bytes of each stream, in wire order, for n elements with n_escapes escapes."""
    return {"codes": (n + 1) // 2, "sm": n, "escapes": ESCAPE_BYTES * n_escapes}


def check_streams(codes: torch.Tensor, sm: torch.Tensor, escapes: torch.Tensor, n: int) -> int:
    """Sizes and types of received streams for n elements -> the escape count."""
    if not _is_int(n) or n < 0:
        raise ValueError(f"n: must be a non-negative int, got {n!r}")
    for name, buf in (("codes", codes), ("sm", sm), ("escapes", escapes)):
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError(f"{name}: must be 1-D uint8, got {buf.dtype} {tuple(buf.shape)}")
    if escapes.numel() % ESCAPE_BYTES:
        raise ValueError(f"escapes: {escapes.numel()} bytes, not a multiple of {ESCAPE_BYTES}")
    n_esc = escapes.numel() // ESCAPE_BYTES
    for name, buf in (("codes", codes), ("sm", sm)):
        if buf.numel() != stream_bytes(n, n_esc)[name]:
            raise ValueError(f"{name}: {buf.numel()} bytes, expected {stream_bytes(n, n_esc)[name]}"
                             f" for n={n}")
    if n_esc > n:
        raise ValueError(f"escapes: {n_esc} escapes for n={n} elements")
    return n_esc


def exponents(x: torch.Tensor) -> torch.Tensor:
    """The 8-bit exponent of each element of a BF16 tensor, as int16 (0..255)."""
    return (check_input(x) >> 7) & 0xFF  # the mask drops the arithmetic shift's sign copies


def codebook_from_counts(counts: list[int]) -> list[int]:
    ranked = sorted(range(NUM_EXPONENTS), key=lambda e: (-counts[e], e))
    return ranked[:NUM_CODES]


class ExponentHistogram:
    """Exponent counts over any number of tensors (cast to BF16 first), kept on the first tensor's
    device until `codebook()` reads them."""

    def __init__(self):
        self.counts: torch.Tensor | None = None

    def add(self, t: torch.Tensor) -> ExponentHistogram:
        bits = exponents(t.detach().to(torch.bfloat16))
        counts = torch.zeros(NUM_EXPONENTS, dtype=torch.int64, device=bits.device)
        for start in range(0, bits.numel(), REFERENCE_BLOCK):
            counts += torch.bincount(bits[start:start + REFERENCE_BLOCK].to(torch.int32),
                                     minlength=NUM_EXPONENTS)
        self.counts = counts if self.counts is None else self.counts + counts.to(self.counts.device)
        return self

    def codebook(self) -> list[int]:
        counts = [0] * NUM_EXPONENTS if self.counts is None else self.counts.tolist()
        return codebook_from_counts(counts)


def calibrate_codebook(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The codebook of a calibration set (module docstring for the ranking)."""
    histogram = ExponentHistogram()
    for t in tensors:
        histogram.add(t)
    return histogram.codebook()


def inverse_lut(codebook: list[int], device: torch.device) -> torch.Tensor:
    """int32 [256]: exponent -> its code, -1 for an exponent outside the codebook."""
    inv = torch.full((NUM_EXPONENTS,), -1, dtype=torch.int32)
    inv[torch.tensor(codebook)] = torch.arange(NUM_CODES, dtype=torch.int32)
    return inv.to(device)


def _le_bytes(values: torch.Tensor, width: int) -> torch.Tensor:
    shifts = torch.arange(0, 8 * width, 8, device=values.device)
    return ((values[:, None] >> shifts) & 0xFF).to(torch.uint8).reshape(-1)


def _from_le_bytes(data: torch.Tensor, width: int) -> torch.Tensor:
    shifts = torch.arange(0, 8 * width, 8, device=data.device)
    return (data.reshape(-1, width).to(torch.int64) << shifts).sum(dim=1)


def pack_escapes(positions: torch.Tensor, exps: torch.Tensor, chunk: int) -> torch.Tensor:
    """Increasing int64 positions and their exponents -> the planar escape buffer."""
    return torch.cat((_le_bytes(positions // chunk, 4), _le_bytes(positions % chunk, 2),
                      exps.to(torch.uint8)))


def unpack_escapes(escapes: torch.Tensor, n: int, chunk: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The escape buffer -> (int64 positions, int32 exponents), checked: chunk ids and offsets in
    range, positions below n and strictly increasing (one wait for the device)."""
    n_esc = escapes.numel() // ESCAPE_BYTES
    ids = _from_le_bytes(escapes[:4 * n_esc], 4)
    offsets = _from_le_bytes(escapes[4 * n_esc:6 * n_esc], 2)
    exps = escapes[6 * n_esc:].to(torch.int32)
    positions = ids * chunk + offsets
    if n_esc:
        n_chunks = (n + chunk - 1) // chunk
        flags = torch.stack(((ids >= n_chunks).any(), (offsets >= chunk).any(),
                             (positions >= n).any(),
                             (positions[1:] <= positions[:-1]).any())).tolist()
        problems = ("a chunk id is out of range", f"an offset is not below the chunk {chunk}",
                    f"a position is not below n={n}", "positions are not strictly increasing")
        for bad, problem in zip(flags, problems):
            if bad:
                raise ValueError(f"escapes: {problem}")
    return positions, exps


def _to_int16(raw: torch.Tensor) -> torch.Tensor:
    """16-bit patterns held in int32 (0..0xFFFF) -> int16 with the same bits."""
    return (raw - ((raw & 0x8000) << 1)).to(torch.int16)


def encode_reference(x: torch.Tensor, codebook: list[int], chunk: int = DEFAULT_CHUNK
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (BF16, any shape) -> (codes, sm, escapes), 1-D uint8 on x's device."""
    codebook, chunk = check_codebook(codebook), check_chunk(chunk)
    bits = check_input(x)
    n, device = bits.numel(), bits.device
    table = inverse_lut(codebook, device).clamp(min=-1).to(torch.uint8)  # escapes: 255
    codes = torch.empty((n + 1) // 2, dtype=torch.uint8, device=device)
    sm = torch.empty(n, dtype=torch.uint8, device=device)
    positions, exps = [], []
    for start in range(0, n, REFERENCE_BLOCK):
        block = bits[start:start + REFERENCE_BLOCK]  # int16: shifts copy the sign, masks drop it
        exp = ((block >> 7) & 0xFF).to(torch.int32)
        code = table.index_select(0, exp)
        escaped = code == 255
        code.masked_fill_(escaped, 0)
        if code.numel() % 2:
            code = torch.cat((code, code.new_zeros(1)))
        codes[start // 2:start // 2 + code.numel() // 2] = code[0::2] | (code[1::2] << 4)
        sm[start:start + block.numel()] = (((block >> 8) & 0x80) | (block & 0x7F)).to(torch.uint8)
        where = torch.nonzero(escaped).squeeze(1)
        positions.append(where + start)
        exps.append(exp[where])
    empty = torch.empty(0, dtype=torch.int64, device=device)
    escapes = pack_escapes(torch.cat(positions) if positions else empty,
                           torch.cat(exps) if exps else empty, chunk)
    return codes, sm, escapes


def decode_reference(codes: torch.Tensor, sm: torch.Tensor, escapes: torch.Tensor,
                     codebook: list[int], n: int, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """The three streams of n elements -> the BF16 elements, 1-D, on the streams' device."""
    codebook, chunk = check_codebook(codebook), check_chunk(chunk)
    check_streams(codes, sm, escapes, n)
    positions, exps = unpack_escapes(escapes, n, chunk)
    lut = torch.tensor(codebook, dtype=torch.int32, device=codes.device)
    out = torch.empty(n, dtype=torch.int16, device=codes.device)
    for start in range(0, n, REFERENCE_BLOCK):
        stop = min(start + REFERENCE_BLOCK, n)
        packed = codes[start // 2:(stop + 1) // 2]
        code = torch.stack((packed & 0xF, packed >> 4), dim=1).reshape(-1)[:stop - start]
        m = sm[start:stop].to(torch.int32)
        exp = lut.index_select(0, code.to(torch.int32))
        out[start:stop] = _to_int16(((m & 0x80) << 8) | (exp << 7) | (m & 0x7F))
    if positions.numel():
        raw = out[positions].to(torch.int32) & 0xFFFF
        out[positions] = _to_int16((raw & 0x807F) | (exps << 7))
    return out.view(torch.bfloat16)
