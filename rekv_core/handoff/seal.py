"""Sealed handoff messages: every message is bound to its handoff, its place and its bytes.

The decode side draws a fresh random key per handoff (`new_key`) and hands it to the prefill side
over the control plane; only the two of them know it. Each message of that handoff is sealed:

    header on the wire = MAC (32 bytes) || protection (1 byte) || header
    MAC = HMAC-SHA256(key, "rekv-seal-2" | request id | sequence number | message name |
                           protection | header | each buffer's name, size and bulk tag)

where each buffer's bulk tag is a keyed MAC over its bytes (`bulk_mac`: Poly1305 with a one-time
key per buffer on the host, the `poly61` polynomial hash on a device), computed by both sides and
never sent. The receiver (`open_message`) recomputes the MAC before anything reads the message: a
message from another handoff (replayed or late: another key), for another request or place
(misdirected), from a process that only reached the data-plane port (no key), or with any byte of
its header or buffers changed by a party without the key is rejected and never written into a
cache. The protection byte says which bulk MAC the sender computed (the receiver computes the
same, and refuses one it did not expect: `aead` only on an encrypted handoff, `sizes` only for
the link probe).

What protects against what:
- unsealed (`key=None` on both sides: benchmarks, tests of the schedule): the checksums in each
  header (`with_checksums`, or a codec's own: CRC32 on the host, wsum64 on a device) catch
  accidents: flipped, lost or reordered bytes. They are linear: anyone on the path can change
  bytes and fix the checksum up, so they are no defence against a party that means harm.
- sealed: the MAC over header and bytes: a party on the path without the key can neither inject
  nor alter nor replay a message, and accidents fail it too. No checksum is computed or sent
  (`with_checksums(..., sealed=True)`, `codec.encode(checksums=False)`), none is checked.
- encrypted (`Sealing.encrypted`): AES-256-GCM (an AEAD) over every buffer, below: its tags
  protect the bytes (no second MAC over them), the seal's MAC the header; and nobody without the
  key reads the bytes.

`Sealing(key, encrypted, binding)` is how one handoff is protected, as both sides take it: with a
`binding` (the model's fingerprint), every MAC and cipher key is derived from the handoff key and
the binding (`Sealing.message_key`), so a message sealed for another model does not verify.

Encryption, for links that others can read (optional; the MAC alone hides nothing): `encrypt`
replaces every buffer of a message by its AES-256-GCM ciphertext with the 16-byte tag appended,
under a key derived from the handoff key with HKDF-SHA256 ("rekv-encrypt-1"), so the cipher key
is never the MAC key. Each buffer's nonce is (sequence number: 8 bytes, buffer index: 4 bytes):
unique because each handoff has a key of its own and sends each sequence number once (a key
reused across handoffs, or a sequence number resent with other bytes, would repeat a nonce and
break GCM). The associated data binds the request id, sequence number, message name and buffer
name, so a buffer moved to another message or place fails its tag. The order is fixed:

    sender:   seal(key, encrypt(key, message), Protection.AEAD)   the MAC covers the sizes
    receiver: decrypt(key, open_message(key, message, Protection.AEAD))

Headers stay in clear (the plan, codec, shapes, sizes). Encryption works on host (CPU) buffers
only; the caller brings device buffers to the host. cryptography >= 47 encrypts straight into
the new tensor; older versions cost one more copy. `cryptography` is imported only where a host
path needs it (encryption, Poly1305), so a sealed handoff between device buffers runs without it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass, replace

import numpy as np
import torch

from rekv_core.codecs.checksum import checksums, default_algorithm, verify_checksums
from rekv_core.handoff.bulk_mac import (Protection, buffer_tags, framed, has_poly1305, mac_for,
                                        place)
from rekv_core.transport import Message, TransportError

KEY_BYTES = 32
MAC_BYTES = 32
SEAL_BYTES = MAC_BYTES + 1  # the MAC and the protection byte in front of a sealed header
TAG_BYTES = 16
MAX_BUFFER_BYTES = 2**31 - 1 - TAG_BYTES  # cryptography's AEADs take at most 2**31 - 1 bytes
_DOMAIN = b"rekv-seal-2"
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
    def sealed(self) -> bool:
        """Whether the seal's MAC (or AES-GCM) covers the bytes, so no checksum needs to."""
        return self.key is not None

    @property
    def message_key(self) -> bytes | None:
        """The key messages are sealed (and encrypted) under: `key` itself without a binding,
        else HMAC-SHA256(key, "rekv-bind-1" | binding)."""
        if self.key is None or not self.binding:
            return self.key
        return hmac.new(self.key, _BIND_DOMAIN + self.binding, hashlib.sha256).digest()


def _mac(key: bytes, message: Message, protection: Protection, header: bytes) -> bytes:
    mac = hmac.new(key, _DOMAIN, hashlib.sha256)
    mac.update(framed(*place(message)) + bytes([protection]))
    mac.update(len(header).to_bytes(8, "little") + header)
    tags = buffer_tags(key, message, protection)
    for (name, buffer), tag in zip(message.buffers.items(), tags):
        size = buffer.numel() * buffer.element_size()
        mac.update(framed(name.encode(), size.to_bytes(8, "little"), tag))
    return mac.digest()


def seal(key: bytes | None, message: Message, protection: Protection | None = None) -> Message:
    """`message` with its MAC and protection in front of its header (unchanged without a key).
    `protection`: `AEAD` for `encrypt`ed buffers, `SIZES` for bytes that carry nothing; by
    default a MAC over every buffer's bytes (`mac_for` their device)."""
    if key is not None:
        protection = mac_for(message.buffers) if protection is None else protection
        message.header = (_mac(key, message, protection, message.header) + bytes([protection])
                          + message.header)
    return message


def open_message(key: bytes | None, message: Message, expect: Protection | None = None
                 ) -> Message:
    """Verify and strip the MAC; `SealError` when it is missing or wrong, or when the message's
    protection is not `expect` (None: a MAC over the bytes, either algorithm)."""
    if key is None:
        return message
    header = message.header
    if len(header) < SEAL_BYTES:
        raise SealError(f"{message.name}: no handoff MAC")
    mac, code, header = header[:MAC_BYTES], header[MAC_BYTES], header[SEAL_BYTES:]
    protection = next((p for p in Protection if p == code), None)
    if protection is Protection.POLY1305 and not has_poly1305():
        raise SealError(f"{message.name}: its host buffers are MACed with Poly1305, which needs "
                        f"the `cryptography` package, missing on this receiver")
    if protection is None or not hmac.compare_digest(mac, _mac(key, message, protection, header)):
        raise SealError(f"{message.name}: handoff MAC mismatch (altered bytes, another "
                        f"handoff's message, a misdirected one, or not from the prefill worker)")
    if protection != expect and not (expect is None and protection.is_mac):
        wanted = "a MAC over the bytes" if expect is None else expect.name.lower()
        raise SealError(f"{message.name}: bulk protection {protection.name.lower()}, "
                        f"expected {wanted}")
    message.header = header
    return message


def with_checksums(buffers: dict[str, torch.Tensor], extra: dict | None = None,
                   sealed: bool = False) -> bytes:
    """A header holding the checksum of every buffer (their device's algorithm), and `extra`
    fields beside them; `sealed`: `extra` alone (the seal's MAC covers the bytes)."""
    if not buffers:
        return b""
    if sealed:
        return json.dumps(extra or {}).encode()
    algorithm = default_algorithm(next(iter(buffers.values())).device)
    return json.dumps({**(extra or {}), "checksum_algorithm": algorithm,
                       "checksums": checksums(buffers, algorithm)}).encode()


def check_checksums(message: Message, sealed: bool = False) -> None:
    """Verify a `with_checksums` header against the buffers; `SealError` names what differs.
    `sealed`: nothing to verify (`open_message` has checked the MAC over the bytes)."""
    if sealed:
        return
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
    arrays = {name: _host_array(message, name, b) for name, b in message.buffers.items()}
    aead = _cipher(key)  # after the buffers' check: a device buffer is refused without it
    buffers = {}
    for index, (name, plain) in enumerate(arrays.items()):
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
    arrays = {name: _host_array(message, name, b) for name, b in message.buffers.items()}
    from cryptography.exceptions import InvalidTag

    aead = _cipher(key)
    buffers = {}
    for index, (name, sealed) in enumerate(arrays.items()):
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


def _cipher(key: bytes):
    """AES-256-GCM under the key derived for encryption (`cryptography`'s AESGCM)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    if key is None:
        raise ValueError("encryption needs the handoff key")
    check_key(key)
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=_ENCRYPT_DOMAIN)
    return AESGCM(hkdf.derive(key))


def _nonce(message: Message, index: int) -> bytes:
    return message.seq.to_bytes(8, "little") + index.to_bytes(4, "little")


def _associated_data(message: Message, buffer_name: str) -> bytes:
    return _ENCRYPT_DOMAIN + framed(*place(message), buffer_name.encode())


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
