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
unsealed; checksums still travel and are checked. `Sealing(key, encrypted, binding)` is how one
handoff is protected, as both sides take it: with a `binding` (the model's fingerprint), every MAC
and cipher key is derived from the handoff key and the binding (`Sealing.message_key`), so a
message sealed for another model does not verify.

Encryption, for links that others can read (optional; the MAC alone hides nothing): `encrypt`
replaces every buffer of a message by its AES-256-GCM ciphertext with the 16-byte tag appended,
under a key derived from the handoff key with HKDF-SHA256 ("rekv-encrypt-1"), so the cipher key
is never the MAC key. Each buffer's nonce is (sequence number: 8 bytes, buffer index: 4 bytes):
unique because each handoff has a key of its own and sends each sequence number once (a key
reused across handoffs, or a sequence number resent with other bytes, would repeat a nonce and
break GCM). The associated data binds the request id, sequence number, message name and buffer
name, so a buffer moved to another message or place fails its tag. The order is fixed:

    sender:   seal(key, encrypt(key, message))     the MAC covers the ciphertext sizes
    receiver: decrypt(key, open_message(key, message)), then check_checksums

Headers stay in clear (the plan, codec, shapes, sizes, and the checksums of the plaintext, which
`check_checksums` or the codec verifies after decryption). Encryption works on host (CPU) buffers
only; the caller brings device buffers to the host. cryptography >= 47 encrypts straight into
the new tensor; older versions cost one more copy.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass, replace

import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from rekv_core.codecs.checksum import checksums, default_algorithm, verify_checksums
from rekv_core.transport import Message, TransportError

KEY_BYTES = 32
MAC_BYTES = 32
TAG_BYTES = 16
MAX_BUFFER_BYTES = 2**31 - 1 - TAG_BYTES  # cryptography's AEADs take at most 2**31 - 1 bytes
_DOMAIN = b"rekv-seal-1"
_ENCRYPT_DOMAIN = b"rekv-encrypt-1"
_BIND_DOMAIN = b"rekv-bind-1"


class SealError(TransportError):
    """A message that is not what the handoff's key says it must be."""


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def check_key(key: bytes | None) -> None:
    if key is not None and len(key) != KEY_BYTES:
        raise ValueError(f"handoff_key: must be {KEY_BYTES} bytes, got {len(key)}")


@dataclass(frozen=True)
class Sealing:
    """How one handoff's messages are protected: sealed under `key` (None: unsealed), and with
    `encrypted` every buffer encrypted under it too (on the host); `binding` (bytes both sides
    must agree on, e.g. the model's fingerprint) goes into every message's key."""

    key: bytes | None = None
    encrypted: bool = False
    binding: bytes = b""

    def __post_init__(self) -> None:
        check_key(self.key)
        if self.encrypted and self.key is None:
            raise ValueError("encrypted: needs the handoff's key")

    @classmethod
    def fresh(cls, encrypted: bool = False) -> Sealing:
        """A new random key (the decode side draws one per handoff)."""
        return cls(new_key(), encrypted)

    @property
    def message_key(self) -> bytes | None:
        """The key messages are sealed (and encrypted) under: `key` itself without a binding,
        else HMAC-SHA256(key, "rekv-bind-1" | binding)."""
        if self.key is None or not self.binding:
            return self.key
        return hmac.new(self.key, _BIND_DOMAIN + self.binding, hashlib.sha256).digest()


def _framed(*parts: bytes) -> bytes:
    return b"".join(len(part).to_bytes(4, "little") + part for part in parts)


def _place(message: Message) -> tuple[bytes, bytes, bytes]:
    return message.request_id.encode(), str(message.seq).encode(), message.name.encode()


def _mac(key: bytes, message: Message, header: bytes) -> bytes:
    mac = hmac.new(key, _DOMAIN, hashlib.sha256)
    mac.update(_framed(*_place(message)))
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


def with_checksums(buffers: dict[str, torch.Tensor], extra: dict | None = None) -> bytes:
    """A header holding the checksum of every buffer (their device's algorithm), and `extra`
    fields beside them."""
    if not buffers:
        return b""
    algorithm = default_algorithm(next(iter(buffers.values())).device)
    return json.dumps({**(extra or {}), "checksum_algorithm": algorithm,
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


def encrypt(key: bytes, message: Message) -> Message:
    """`message` with every buffer replaced by its ciphertext and tag (16 bytes longer); the
    message passed in is left as it was."""
    aead = _cipher(key)
    buffers = {}
    for index, (name, buffer) in enumerate(message.buffers.items()):
        plain = _host_array(message, name, buffer)
        if plain.nbytes > MAX_BUFFER_BYTES:
            raise ValueError(f"{message.name}: buffer {name}: {plain.nbytes} bytes, more than "
                             f"the {MAX_BUFFER_BYTES} one AES-GCM call takes")
        sealed = torch.empty(plain.nbytes + TAG_BYTES, dtype=torch.uint8)
        _run(getattr(aead, "encrypt_into", None), aead.encrypt, _nonce(message, index), plain,
             _associated_data(message, name), sealed.numpy())
        buffers[name] = sealed
    return replace(message, buffers=buffers)


def decrypt(key: bytes, message: Message) -> Message:
    """The plaintext of an `encrypt`ed message; `SealError` naming the message and buffer whose
    tag does not hold (altered bytes, another message's buffer, another place, another key)."""
    aead = _cipher(key)
    buffers = {}
    for index, (name, buffer) in enumerate(message.buffers.items()):
        sealed = _host_array(message, name, buffer)
        if sealed.nbytes < TAG_BYTES:
            raise SealError(f"{message.name}: buffer {name}: {sealed.nbytes} bytes, too short "
                            f"for an encrypted buffer")
        plain = torch.empty(sealed.nbytes - TAG_BYTES, dtype=torch.uint8)
        try:
            _run(getattr(aead, "decrypt_into", None), aead.decrypt, _nonce(message, index),
                 sealed, _associated_data(message, name), plain.numpy())
        except InvalidTag:
            raise SealError(f"{message.name}: buffer {name}: does not decrypt (altered, another "
                            f"message's, or another handoff's key)") from None
        buffers[name] = plain
    return replace(message, buffers=buffers)


def _cipher(key: bytes) -> AESGCM:
    if key is None:
        raise ValueError("encryption needs the handoff key")
    check_key(key)
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=_ENCRYPT_DOMAIN)
    return AESGCM(hkdf.derive(key))


def _nonce(message: Message, index: int) -> bytes:
    return message.seq.to_bytes(8, "little") + index.to_bytes(4, "little")


def _associated_data(message: Message, buffer_name: str) -> bytes:
    return _ENCRYPT_DOMAIN + _framed(*_place(message), buffer_name.encode())


def _host_array(message: Message, name: str, buffer: torch.Tensor) -> np.ndarray:
    """The buffer's bytes as an array sharing its memory (a copy only if it is not contiguous)."""
    if buffer.device.type != "cpu":
        raise ValueError(f"{message.name}: buffer {name} is on {buffer.device}: encryption runs "
                         f"on host memory; bring device buffers to the host first")
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"{message.name}: buffer {name}: must be 1-D uint8, got "
                         f"{buffer.dim()}-D {buffer.dtype}")
    return buffer.contiguous().numpy()


def _run(into, whole, nonce: bytes, data: np.ndarray, aad: bytes, out: np.ndarray) -> None:
    """`into(nonce, data, aad, out)` (cryptography >= 47); without it, `whole`'s bytes copied."""
    if into is not None:
        into(nonce, data, aad, out)
    else:
        out[:] = np.frombuffer(whole(nonce, data, aad), dtype=np.uint8)
