"""Keyed MACs over a sealed message's bulk bytes: what binds each buffer's bytes to the handoff's
key (`seal` feeds every buffer's tag into the message's HMAC; a tag is never sent).

How a message's buffers are protected, named by one byte in the sealed header so that the
receiver computes what the sender did (`Protection`):
- `poly1305` (host buffers): Poly1305 (OpenSSL, through `cryptography`) under a one-time key per
  (message, buffer): HMAC-SHA256(message key, "rekv-poly1305-1" | request id | seq | message name
  | buffer name). A party without the key forges a buffer with probability about 2^-100 per
  attempt (Poly1305's bound: 8·⌈n/16⌉ / 2^106 for n bytes).
- `poly61` (device buffers): the polynomial hash over GF(2^61 − 1) of `rekv_core.kernels`
  (`poly61`: a Triton kernel on CUDA, its PyTorch reference elsewhere, so a GPU sender's message
  verifies on a CPU receiver), at a point r = HMAC-SHA256(message key, "rekv-poly61-1") mod p,
  one per handoff; the HMAC over it is the per-message PRF that finalises it. Forgery: at most
  m / (2^61 − 1) per attempt for a buffer of m 32-bit words (2^-37 at 64 MiB).
- `aead`: the buffers are AES-256-GCM ciphertexts (`encrypt`), whose tags `decrypt` checks: no
  second MAC over them.
- `sizes`: the buffers carry only their length (the link probe's zeros, written nowhere): their
  sizes are bound, their bytes are not read.

`cryptography` is imported only for `poly1305`, so the device path runs where it is missing; a
sender without it MACs host buffers with `poly61` too (its PyTorch reference), which any receiver
verifies: the weaker bound above instead of Poly1305's, and on the CPU far slower (0.1 GB/s
against Poly1305's 2.8-8.5 GB/s, 1-64 MiB, one core: bench/results/seal-cpu.md). The choice is
the sender's, under the message's HMAC, so a party on the path cannot downgrade it. A receiver
without `cryptography` that is sent `poly1305` refuses the message, naming the package: both
sides of a deployment install the same packages.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import logging

import torch

from rekv_core import streams
from rekv_core.kernels import Poly61Key, poly61_many
from rekv_core.kernels.polymac_reference import P61
from rekv_core.transport import Message

logger = logging.getLogger(__name__)

_POLY1305_DOMAIN = b"rekv-poly1305-1"
_POLY61_DOMAIN = b"rekv-poly61-1"


class Protection(enum.IntEnum):
    """What guards a sealed message's buffers; the value is its byte on the wire."""

    SIZES = 0
    AEAD = 1
    POLY1305 = 2
    POLY61 = 3

    @property
    def is_mac(self) -> bool:
        return self in (Protection.POLY1305, Protection.POLY61)


def mac_for(buffers: dict[str, torch.Tensor]) -> Protection:
    """Poly1305 when every buffer is on the host and `cryptography` is installed, else poly61."""
    on_host = all(b.device.type == "cpu" for b in buffers.values())
    return Protection.POLY1305 if on_host and has_poly1305() else Protection.POLY61


@functools.cache
def has_poly1305() -> bool:
    """Whether `cryptography`'s Poly1305 (OpenSSL's) imports here; logged once when not."""
    try:
        from cryptography.hazmat.primitives.poly1305 import Poly1305  # noqa: F401
    except ImportError:
        logger.warning("cryptography's Poly1305 is not importable here: sealed host buffers are "
                       "MACed with poly61 (PyTorch reference; forgery bound m/2^61 per attempt "
                       "instead of 2^-100, and slower on the CPU)")
        return False
    return True


def framed(*parts: bytes) -> bytes:
    return b"".join(len(part).to_bytes(4, "little") + part for part in parts)


def place(message: Message) -> tuple[bytes, bytes, bytes]:
    return message.request_id.encode(), str(message.seq).encode(), message.name.encode()


def buffer_tags(key: bytes, message: Message, protection: Protection) -> list[bytes]:
    """The tag of each of the message's buffers (in order) under `protection`; empty tags when
    it is not a MAC."""
    buffers = message.buffers
    if not protection.is_mac or not buffers:
        return [b""] * len(buffers)
    streams.wait_ready(message.ready, buffers.values())  # the MAC reads what the producer wrote
    if protection is Protection.POLY61:
        values = poly61_many([_flat(b) for b in buffers.values()], _poly61_key(key))
        return [value.to_bytes(8, "little") for value in values]
    from cryptography.hazmat.primitives.poly1305 import Poly1305  # mac_for, open_message check

    return [Poly1305.generate_tag(_one_time_key(key, message, name), _host_bytes(buffer))
            for name, buffer in buffers.items()]


def _flat(buffer: torch.Tensor) -> torch.Tensor:
    return buffer.detach().contiguous().reshape(-1).view(torch.uint8)


def _host_bytes(buffer: torch.Tensor) -> memoryview:
    return memoryview(_flat(buffer).cpu().numpy())


def _one_time_key(key: bytes, message: Message, name: str) -> bytes:
    return hmac.new(key, _POLY1305_DOMAIN + framed(*place(message), name.encode()),
                    hashlib.sha256).digest()


@functools.lru_cache(maxsize=16)
def _poly61_key(key: bytes) -> Poly61Key:
    """The handoff's point and its power tables (computed once per message key)."""
    digest = hmac.new(key, _POLY61_DOMAIN, hashlib.sha256).digest()
    return Poly61Key(1 + int.from_bytes(digest[:8], "little") % (P61 - 1))
