"""Encrypted buffers (`seal.encrypt` / `seal.decrypt`): bit-exact round trips, ciphertext that
depends on the message's place, and every alteration, move or wrong key rejected as `SealError`."""

import pytest
import torch

from rekv_core.handoff import seal
from rekv_core.handoff.bulk_mac import Protection
from rekv_core.handoff.seal import TAG_BYTES, SealError, decrypt, encrypt, new_key
from rekv_core.transport import Message
from tests.support.without_cryptography import without_cryptography


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _message(sizes=(4097, 33), seq=3, request_id="r1", name="layer.3", seed=0) -> Message:
    buffers = {f"b{i}": _bytes(n, seed + i) for i, n in enumerate(sizes)}
    return Message(request_id, seq, name, seal.with_checksums(buffers), buffers)


def _clone(message: Message, **changes) -> Message:
    fields = {"request_id": message.request_id, "seq": message.seq, "name": message.name,
              "header": message.header} | changes
    buffers = {name: b.clone() for name, b in message.buffers.items()}
    return Message(fields["request_id"], fields["seq"], fields["name"], fields["header"], buffers)


SIZES = [(0,), (1,), (15,), (16,), (17,), (4097,), (1 << 20,), (0, 3, 65537, 16)]


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_round_trip_is_bit_exact(sizes):
    key, message = new_key(), _message(sizes)
    encrypted = encrypt(key, message)
    assert list(encrypted.buffers) == list(message.buffers)
    for name, buffer in message.buffers.items():
        assert encrypted.buffers[name].numel() == buffer.numel() + TAG_BYTES
    decrypted = decrypt(key, encrypted)
    assert (decrypted.request_id, decrypted.seq, decrypted.name, decrypted.header) == (
        message.request_id, message.seq, message.name, message.header)
    for name, buffer in message.buffers.items():
        assert decrypted.buffers[name].dtype == torch.uint8
        assert torch.equal(decrypted.buffers[name], buffer), name


def test_encrypt_leaves_the_message_passed_in_as_it_was():
    key, message = new_key(), _message()
    before = {name: b.clone() for name, b in message.buffers.items()}
    encrypted = encrypt(key, message)
    assert encrypted is not message
    for name, buffer in message.buffers.items():
        assert torch.equal(buffer, before[name])


def test_a_non_contiguous_buffer_is_encrypted_as_its_bytes():
    key, strided = new_key(), _bytes(200)[::2]
    assert not strided.is_contiguous()
    message = Message("r1", 0, "boundary", b"", {"h": strided})
    assert torch.equal(decrypt(key, encrypt(key, message)).buffers["h"], strided)


def test_ciphertext_hides_the_plaintext():
    key, message = new_key(), _message((4096,))
    plain, cipher = message.buffers["b0"], encrypt(key, message).buffers["b0"]
    assert not torch.equal(cipher[:plain.numel()], plain)
    assert (cipher[:plain.numel()] == plain).float().mean() < 0.05  # chance: 1/256 per byte


def test_the_same_bytes_encrypt_differently_at_another_seq_or_buffer_index():
    key, data = new_key(), _bytes(4096)
    first = encrypt(key, Message("r1", 1, "layer.1", b"", {"a": data, "b": data.clone()}))
    second = encrypt(key, Message("r1", 2, "layer.1", b"", {"a": data}))
    assert not torch.equal(first.buffers["a"], second.buffers["a"])
    assert not torch.equal(first.buffers["a"], first.buffers["b"])


def test_the_same_message_and_key_encrypt_alike():
    key, message = new_key(), _message()
    first, second = encrypt(key, message), encrypt(key, message)
    for name in message.buffers:
        assert torch.equal(first.buffers[name], second.buffers[name])


@pytest.mark.parametrize("buffer", ["b0", "b1", "b2"])
@pytest.mark.parametrize("where", ["first", "middle", "tag"])
def test_a_flipped_bit_in_any_buffer_is_rejected(buffer, where):
    key = new_key()
    encrypted = encrypt(key, _message((100, 1, 0)))
    target = encrypted.buffers[buffer]
    position = {"first": 0, "middle": target.numel() // 2, "tag": target.numel() - 1}[where]
    target[position] ^= 1 << 5
    with pytest.raises(SealError, match=f"layer.3: buffer {buffer}: does not decrypt"):
        decrypt(key, encrypted)


@pytest.mark.parametrize("cut", [1, TAG_BYTES, TAG_BYTES + 1, 65])  # 65: 15 bytes left
def test_a_truncated_buffer_is_rejected(cut):
    key = new_key()
    encrypted = encrypt(key, _message((64,)))
    encrypted.buffers["b0"] = encrypted.buffers["b0"][:-cut].clone()
    left = 64 + TAG_BYTES - cut
    with pytest.raises(SealError, match=f"buffer b0: {left} bytes, too short" if left < TAG_BYTES
                       else "buffer b0"):
        decrypt(key, encrypted)


def test_a_buffer_swapped_between_two_messages_is_rejected():
    key = new_key()
    first = encrypt(key, _message((256,), seq=4, name="layer.4"))
    second = encrypt(key, _message((256,), seq=5, name="layer.5"))
    first.buffers["b0"], second.buffers["b0"] = second.buffers["b0"], first.buffers["b0"]
    for message in (first, second):
        with pytest.raises(SealError, match=f"{message.name}: buffer b0"):
            decrypt(key, message)


def test_two_buffers_swapped_within_a_message_are_rejected():
    key = new_key()
    encrypted = encrypt(key, _message((64, 64)))
    b = encrypted.buffers
    encrypted.buffers = {"b0": b["b1"], "b1": b["b0"]}
    with pytest.raises(SealError, match="buffer b0"):
        decrypt(key, encrypted)


@pytest.mark.parametrize("change", [{"seq": 4}, {"request_id": "r2"}, {"name": "layer.4"}],
                         ids=lambda c: next(iter(c)))
def test_a_message_moved_to_another_place_is_rejected(change):
    key = new_key()
    moved = _clone(encrypt(key, _message()), **change)
    with pytest.raises(SealError, match="does not decrypt"):
        decrypt(key, moved)


def test_another_key_is_rejected():
    encrypted = encrypt(new_key(), _message())
    with pytest.raises(SealError, match="does not decrypt"):
        decrypt(new_key(), encrypted)


def test_the_cipher_key_is_not_the_handoff_key():
    """AES-GCM under the raw handoff key (the MAC's key) must not open the ciphertext."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key, message = new_key(), _message((64,))
    cipher = encrypt(key, message).buffers["b0"].numpy().tobytes()
    with pytest.raises(InvalidTag):
        AESGCM(key).decrypt(seal._nonce(message, 0), cipher,
                            seal._associated_data(message, "b0"))


@pytest.mark.parametrize("key", [None, b"short"], ids=["none", "short"])
def test_encryption_needs_a_handoff_key(key):
    for operation in (encrypt, decrypt):
        with pytest.raises(ValueError, match="key") as raised:
            operation(key, _message())
        if key is None:
            assert str(raised.value) == "encryption needs the handoff key"


def test_the_ciphertext_is_the_documented_construction():
    """Known answer, built here from `cryptography` alone: AES-256-GCM under HKDF-SHA256(handoff
    key, no salt, info "rekv-encrypt-1"), nonce seq (8 bytes) then buffer index (4), both little
    endian, associated data the domain then the length-prefixed (4 bytes, little endian) request
    id, seq, message name and buffer name. Another version must read the same bytes."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    key, message = bytes(range(32)), _message((40, 7), seq=258, request_id="req-9",
                                              name="layer.12")
    derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                   info=b"rekv-encrypt-1").derive(key)
    encrypted = encrypt(key, message)
    for index, name in enumerate(("b0", "b1")):
        nonce = (258).to_bytes(8, "little") + index.to_bytes(4, "little")
        aad = b"rekv-encrypt-1" + b"".join(len(part).to_bytes(4, "little") + part for part in (
            b"req-9", b"258", b"layer.12", name.encode()))
        want = AESGCM(derived).encrypt(nonce, message.buffers[name].numpy().tobytes(), aad)
        assert encrypted.buffers[name].numpy().tobytes() == want, name


def test_a_buffer_up_to_one_calls_limit_is_encrypted_and_one_byte_more_refused(monkeypatch):
    monkeypatch.setattr(seal, "MAX_BUFFER_BYTES", 64)
    key = new_key()
    assert torch.equal(decrypt(key, encrypt(key, _message((64,)))).buffers["b0"],
                       _message((64,)).buffers["b0"])
    with pytest.raises(ValueError, match="layer.3: buffer b0: 65 bytes, more than the 64"):
        encrypt(key, _message((65,)))


def test_encrypt_then_seal_composes_with_open_then_decrypt():
    key, message = new_key(), _message((4097, 0, 33))
    plain = {name: b.clone() for name, b in message.buffers.items()}
    wire = seal.seal(key, encrypt(key, message), Protection.AEAD)
    received = _clone(wire)
    opened = seal.open_message(key, received, Protection.AEAD)
    with pytest.raises(SealError, match="checksum mismatch"):
        seal.check_checksums(opened)  # still ciphertext: the checksums are the plaintext's
    decrypted = decrypt(key, opened)
    seal.check_checksums(decrypted)
    for name, buffer in plain.items():
        assert torch.equal(decrypted.buffers[name], buffer)


def test_the_mac_covers_the_ciphertext_sizes():
    key = new_key()
    wire = seal.seal(key, encrypt(key, _message((64,))), Protection.AEAD)
    wire.buffers["b0"] = wire.buffers["b0"][:-1].clone()
    with pytest.raises(SealError, match="MAC"):
        seal.open_message(key, wire, Protection.AEAD)


def test_device_buffers_are_refused_with_a_clear_error():
    """A buffer off the host (here on the meta device, which runs anywhere) is not encrypted."""
    key = new_key()
    message = Message("r1", 0, "layer.0", b"", {"k": torch.empty(64, dtype=torch.uint8,
                                                                   device="meta")})
    for operation in (encrypt, decrypt):
        with pytest.raises(ValueError, match="layer.0: buffer k is on meta: encryption runs on "
                                             "host memory"):
            operation(key, message)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_buffers_are_refused_with_a_clear_error():
    key = new_key()
    message = Message("r1", 0, "layer.0", b"", {"k": torch.zeros(64, dtype=torch.uint8,
                                                                   device="cuda")})
    with pytest.raises(ValueError, match="on cuda:0: encryption runs on host memory"):
        encrypt(key, message)


def test_a_buffer_that_is_not_1d_uint8_is_refused():
    message = Message("r1", 0, "layer.0", b"", {"k": torch.zeros(4, dtype=torch.float32)})
    with pytest.raises(ValueError, match="must be 1-D uint8"):
        encrypt(new_key(), message)


class _WithoutInto:
    """An AESGCM as cryptography < 47 has it: `encrypt` and `decrypt` only."""

    def __init__(self, aead):
        self.encrypt, self.decrypt = aead.encrypt, aead.decrypt


def test_older_cryptography_without_encrypt_into_gives_the_same_bytes(monkeypatch):
    key, message = new_key(), _message((0, 17, 4097))
    current = encrypt(key, message)
    cipher = seal._cipher
    monkeypatch.setattr(seal, "_cipher", lambda k: _WithoutInto(cipher(k)))
    older = encrypt(key, message)
    for name, buffer in message.buffers.items():
        assert torch.equal(older.buffers[name], current.buffers[name])
        assert torch.equal(decrypt(key, current).buffers[name], buffer)
    older.buffers["b1"][0] ^= 1
    with pytest.raises(SealError, match="buffer b1"):
        decrypt(key, older)


def _handoff(model, action, send_encrypted: bool, receive_encrypted: bool):
    import threading

    from rekv_core.handoff import Sealing, receive_handoff, send_handoff
    from rekv_core.handoff.transfer import Transfer
    from rekv_core.model import prefill
    from rekv_core.transport.inprocess import InProcessLink
    from tests.support.inprocess_handoff import planned

    ids = list(range(1, 41))
    state, key = prefill(model, ids), new_key()
    with InProcessLink() as link:
        link.receiver.open("enc")

        def send():
            try:
                send_handoff(link.sender, *planned(model, ids, action, state),
                             Transfer("enc", stall_s=3.0), Sealing(key, send_encrypted))
            except Exception:  # noqa: BLE001 - the receiver's outcome is what is tested
                pass

        thread = threading.Thread(target=send)
        thread.start()
        try:
            return state, receive_handoff(model, link.receiver, Transfer("enc", stall_s=3.0),
                                          Sealing(key, receive_encrypted))
        finally:
            thread.join()


@pytest.mark.parametrize("codec,cut", [("bf16", 30), ("int8", 12), ("bf16", 0)])
def test_an_encrypted_handoff_rebuilds_the_same_cache(smollm_bf16, codec, cut):
    from rekv_core.handoff import Action

    action = Action(codec, cut, smollm_bf16.shape.num_layers)
    _, plain = _handoff(smollm_bf16, action, False, False)
    _, sealed = _handoff(smollm_bf16, action, True, True)
    assert torch.equal(plain.logits, sealed.logits)
    for layer in range(smollm_bf16.shape.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(plain.cache.layer(layer),
                                                     sealed.cache.layer(layer)))


def test_a_receiver_that_expects_encryption_refuses_plaintext(smollm_bf16):
    from rekv_core.handoff import Action

    with pytest.raises(SealError):
        _handoff(smollm_bf16, Action("int8", 12, smollm_bf16.shape.num_layers), False, True)


def test_a_device_buffer_is_refused_by_name_where_cryptography_is_missing(monkeypatch):
    """The GPU image has no `cryptography`: the buffer's place is checked first, so a device
    buffer still gets the clear refusal, not an import error."""
    without_cryptography(monkeypatch)
    message = Message("r1", 0, "layer.0", b"", {"k": torch.empty(64, dtype=torch.uint8,
                                                                   device="meta")})
    for operation in (encrypt, decrypt):
        with pytest.raises(ValueError, match="buffer k is on meta"):
            operation(new_key(), message)
