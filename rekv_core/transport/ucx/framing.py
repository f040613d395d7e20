"""What a message looks like on the UCX wire: its tags, its frame, and the views sent from.

Part p of message seq of request r travels under the 64-bit UCX tag `H(r) << 16 | seq << 4 | p`
(`message_tag`), where H is a 48-bit BLAKE2 hash of the request id: at most `MAX_SEQ` + 1 messages
per request and `MAX_BUFFERS` buffers per message (parts 1..15). Part 0 is the frame
(`encode_frame`, `decode_frame`): a little-endian u32 length, then JSON naming the request, the
message's seq, name and header (latin-1), and each buffer's name, size in bytes and memory kind
(`cpu`, `cuda`); at most `MAX_FRAME` bytes in all. `wire_view` is what a buffer is sent from or
received into.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch

from rekv_core.transport.base import Message, TransportError

MAX_FRAME = 1 << 16  # bytes of part 0 of a message
MAX_BUFFERS = 15
MAX_SEQ = (1 << 12) - 1
MEMORY_KINDS = ("cpu", "cuda")


def message_tag(request_id: str, seq: int, part: int) -> int:
    if not 0 <= seq <= MAX_SEQ:
        raise TransportError(f"request {request_id}: message {seq} beyond {MAX_SEQ} per request")
    digest = hashlib.blake2b(request_id.encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big") << 16 | seq << 4 | part


def check_buffer_count(name: str, count: int) -> None:
    if count > MAX_BUFFERS:
        raise TransportError(f"{name}: {count} buffers, at most {MAX_BUFFERS}")


def encode_frame(message: Message) -> bytes:
    meta = {"request_id": message.request_id, "seq": message.seq, "name": message.name,
            "header": message.header.decode("latin-1"),
            "buffers": [[name, int(buf.numel()), buf.device.type]
                        for name, buf in message.buffers.items()]}
    body = json.dumps(meta).encode()
    frame = struct.pack("<I", len(body)) + body
    if len(frame) > MAX_FRAME:
        raise TransportError(f"{message.name}: frame of {len(frame)} bytes exceeds {MAX_FRAME}")
    return frame


def decode_frame(raw: torch.Tensor, max_message_bytes: int = 0) -> dict:
    """The frame's fields, each checked (types, counts, sizes, and the buffers' total against
    `max_message_bytes` when > 0) before anything is allocated for them: `TransportError`
    naming the field otherwise. The frame is the peer's: nothing in it is trusted."""
    data = raw.numpy().tobytes()
    if len(data) < 4:
        raise TransportError(f"frame: {len(data)} bytes, shorter than its length prefix")
    (length,) = struct.unpack_from("<I", data)
    if length + 4 > len(data):
        raise TransportError(f"frame: announces {length} bytes, holds {len(data) - 4}")
    try:
        meta = json.loads(data[4:4 + length])
    except ValueError as exc:
        raise TransportError(f"frame: not JSON ({exc})") from None
    _check_frame(meta, max_message_bytes)
    return meta


def _check_frame(meta, max_message_bytes: int) -> None:
    if not isinstance(meta, dict):
        raise TransportError("frame: not a JSON object")
    for key, kind in (("request_id", str), ("seq", int), ("name", str), ("header", str),
                      ("buffers", list)):
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise TransportError(f"frame.{key}: missing or not a {kind.__name__}")
    buffers = meta["buffers"]
    check_buffer_count(meta["name"], len(buffers))
    total = 0
    for entry in buffers:
        if (not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], str)
                or not isinstance(entry[1], int) or isinstance(entry[1], bool) or entry[1] < 0
                or entry[2] not in MEMORY_KINDS):
            raise TransportError(f"frame.buffers: {str(entry)[:80]} is not [name, bytes >= 0, "
                                 f"one of {MEMORY_KINDS}]")
        total += entry[1]
    if max_message_bytes and total > max_message_bytes:
        raise TransportError(f"frame.buffers: {total} bytes in all, beyond this receiver's "
                             f"limit of {max_message_bytes}")


def wire_view(buffer: torch.Tensor):
    """What ucxx sends from: the numpy view of a host tensor, the CUDA tensor itself."""
    buffer = buffer.contiguous()
    return buffer if buffer.is_cuda else buffer.numpy()
