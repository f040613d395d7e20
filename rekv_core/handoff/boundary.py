"""How the boundary h_c travels: BF16 as it is, or SplitZip-coded, lossless either way.

`Action.boundary` names the boundary's coding (`BOUNDARY_CODINGS`):
- `bf16`: each chunk's rows as BF16, one buffer `h` (2 bytes per element);
- `splitzip`: each chunk's rows as SplitZip streams `codes`, `sm`, `escapes`
  (`codecs.splitzip.encode_bf16`), the tensor meta (codebook, element count, chunk, escape count)
  in the message header beside the checksums (of an unsealed handoff). The codebook is the model's, calibrated on boundary
  states (the policy's `splitzip.boundary`), else ranked from this handoff's h_c.

`encode_chunk(rows, coding, codebook)` gives a chunk's buffers and its header's extra fields;
`decode_chunk(message, shape, coding, sealed)` checks a received chunk (checksums unless sealed,
sizes, meta) and gives its rows as BF16, bit for bit what was sent, or raises `TransportError`
naming what is wrong. `boundary_bytes(n, coding)` is the wire size the planner expects for n elements.
"""

from __future__ import annotations

import json

import torch

from rekv_core import streams
from rekv_core.codecs import CorruptPayloadError
from rekv_core.codecs.splitzip import EXPECTED_ESCAPE_RATE, STREAMS, decode_bf16, encode_bf16
from rekv_core.handoff.seal import check_checksums
from rekv_core.kernels import calibrate_codebook
from rekv_core.kernels.splitzip_reference import stream_bytes
from rekv_core.transport import Message, TransportError
from rekv_core.units import BF16_BYTES

BOUNDARY_CODINGS = ("bf16", "splitzip")


def check_coding(coding: str) -> str:
    if coding not in BOUNDARY_CODINGS:
        raise ValueError(f"boundary: must be one of {', '.join(BOUNDARY_CODINGS)}, got "
                         f"{coding!r}")
    return coding


def boundary_bytes(elements: int, coding: str) -> int:
    """Expected wire bytes of `elements` boundary values (exact for `bf16`)."""
    if check_coding(coding) == "bf16":
        return elements * BF16_BYTES
    return sum(stream_bytes(elements, round(elements * EXPECTED_ESCAPE_RATE)).values())


def chunk_codebook(h_c: torch.Tensor, coding: str, codebook: list[int] | None
                   ) -> list[int] | None:
    """The codebook the chunks of `h_c` are coded with: the model's, else ranked from h_c."""
    if coding != "splitzip":
        return None
    return codebook if codebook is not None else calibrate_codebook([h_c])


def encode_chunk(rows: torch.Tensor, coding: str, codebook: list[int] | None
                 ) -> tuple[dict[str, torch.Tensor], dict]:
    """BF16 rows -> (buffers, extra header fields)."""
    if coding == "bf16":
        return {"h": rows.contiguous().reshape(-1).view(torch.uint8)}, {}
    buffers, meta = encode_bf16(rows, codebook)
    return buffers, {"splitzip": meta}


def decode_chunk(message: Message, shape: tuple[int, ...], coding: str, sealed: bool = False
                 ) -> torch.Tensor:
    """A received chunk (or `head`) -> its rows `shape`, BF16, on the buffers' device; `sealed`:
    its bytes were verified by the seal's MAC, no checksums to check."""
    streams.wait_ready(message.ready, message.buffers.values())
    check_checksums(message, sealed)
    elements = int(torch.Size(shape).numel())
    if coding == "bf16":
        buf = message.buffers.get("h")
        expected = elements * BF16_BYTES
        if list(message.buffers) != ["h"] or buf.dtype != torch.uint8 or buf.numel() != expected:
            got = None if buf is None else buf.numel()
            raise TransportError(f"{message.name}: expected {expected} BF16 bytes, got {got}")
        return buf.view(torch.bfloat16).reshape(shape)
    try:
        meta = json.loads(message.header)["splitzip"]
        if not isinstance(meta, dict) or meta.get("n") != elements:
            raise CorruptPayloadError(f"meta.n: expected {elements} elements")
        if set(message.buffers) != set(STREAMS):
            raise CorruptPayloadError(f"buffers: got {sorted(message.buffers)}, need "
                                      f"{list(STREAMS)}")
        return decode_bf16(message.buffers, meta).reshape(shape)
    except (CorruptPayloadError, ValueError, KeyError, TypeError) as exc:
        raise TransportError(f"{message.name}: unreadable SplitZip boundary ({exc})") from None
