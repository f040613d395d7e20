"""Sealed handoff messages: every message is bound to its handoff, its place and its bytes.

The decode side draws a fresh random key per handoff (`new_key`) and hands it to the prefill side
over the control plane; only the two of them know it. Each message of that handoff is sealed:

    header on the wire = MAC (32 bytes) || header
    MAC = HMAC-SHA256(key, "rekv-seal-1" | request id | sequence number | message name | header |
                           each buffer's name and size)

and the header itself holds a checksum of every buffer (`with_checksums`, or a codec's own header
for encoded layers), so the MAC, computed over a few hundred bytes, covers the bulk bytes too
without reading them a second time. The receiver (`open_message`) recomputes the MAC before it
reads anything else: a message from another handoff (replayed or late: another key), for another
request or place (misdirected), or from a process that only reached the data-plane port (no key)
is rejected and never written into a cache. `check_checksums` then verifies the bytes of a
message whose header carries its checksums (the codec verifies an encoded layer's).

A handoff without a key (`key=None` on both sides: benchmarks, tests of the schedule) is
unsealed; checksums still travel and are checked.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

import torch

from rekv_core.codecs.checksum import checksums, default_algorithm, verify_checksums
from rekv_core.transport import Message, TransportError

KEY_BYTES = 32
MAC_BYTES = 32
_DOMAIN = b"rekv-seal-1"


class SealError(TransportError):
    """A message that is not what the handoff's key says it must be."""


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def check_key(key: bytes | None) -> None:
    if key is not None and len(key) != KEY_BYTES:
        raise ValueError(f"handoff_key: must be {KEY_BYTES} bytes, got {len(key)}")


def _mac(key: bytes, message: Message, header: bytes) -> bytes:
    mac = hmac.new(key, _DOMAIN, hashlib.sha256)
    for part in (message.request_id.encode(), str(message.seq).encode(), message.name.encode()):
        mac.update(len(part).to_bytes(4, "little") + part)
    mac.update(len(header).to_bytes(8, "little") + header)
    for name, buffer in message.buffers.items():
        mac.update(name.encode() + b"\0" + (buffer.numel() * buffer.element_size()).to_bytes(
            8, "little"))
    return mac.digest()


def seal(key: bytes | None, message: Message) -> Message:
    """`message` with its MAC in front of its header (unchanged without a key)."""
    if key is not None:
        message.header = _mac(key, message, message.header) + message.header
    return message


def open_message(key: bytes | None, message: Message) -> Message:
    """Verify and strip the MAC; `SealError` when it is missing or wrong."""
    if key is None:
        return message
    header = message.header
    if len(header) < MAC_BYTES:
        raise SealError(f"{message.name}: no handoff MAC")
    mac, header = header[:MAC_BYTES], header[MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(key, message, header)):
        raise SealError(f"{message.name}: handoff MAC mismatch (another handoff's message, "
                        f"a misdirected one, or not from the prefill worker)")
    message.header = header
    return message


def with_checksums(buffers: dict[str, torch.Tensor]) -> bytes:
    """A header holding the checksum of every buffer (their device's algorithm)."""
    if not buffers:
        return b""
    algorithm = default_algorithm(next(iter(buffers.values())).device)
    return json.dumps({"checksum_algorithm": algorithm,
                       "checksums": checksums(buffers, algorithm)}).encode()


def check_checksums(message: Message) -> None:
    """Verify a `with_checksums` header against the buffers; `SealError` names what differs."""
    try:
        meta = json.loads(message.header) if message.header else {}
        algorithm, expected = meta["checksum_algorithm"], meta["checksums"]
    except (ValueError, KeyError, TypeError):
        raise SealError(f"{message.name}: no readable checksums in the header") from None
    if set(expected) != set(message.buffers):
        raise SealError(f"{message.name}: checksums for {sorted(expected)}, buffers "
                        f"{sorted(message.buffers)}")
    verify_checksums(message.buffers, algorithm, expected, SealError, f"{message.name}: ")
