"""Forgeries by a party on the path without the handoff's key: bytes changed and their linear
checksum fixed up (CRC32 on the host, wsum64 on a device), on an INT8 layer, a BF16 layer, the
boundary and the token ids. Each forgery is first shown to keep the checksum and to get through an
unsealed handoff into the cache (the test has teeth); sealed, the receiver rejects it (SealError)
before anything is written. The device profile (wsum64 headers, the poly61 MAC) runs on the CPU
through both references, as a GPU sender's handoff does on a CPU receiver."""

import json

import pytest
import torch

from rekv_core.codecs.checksum import checksum
from rekv_core.handoff import Action
from rekv_core.handoff import seal as seal_module
from rekv_core.handoff.bulk_mac import Protection
from rekv_core.handoff.seal import (SEAL_BYTES, SealError, new_key, open_message, seal,
                                    with_checksums)
from rekv_core.model import prefill
from rekv_core.transport import Message
from tests.support.forgery import keep_crc32, keep_wsum64
from tests.support.inprocess_handoff import run_handoff
from tests.support.without_cryptography import without_cryptography

IDS = list(range(1, 41))
POISON = 0x7F  # 16 bytes of it: INT8 codes of 127, BF16 values of 3.39e38


def _poison_crc32(buffer: torch.Tensor) -> torch.Tensor:
    original = buffer.clone()
    buffer[:16] = POISON
    return keep_crc32(original, buffer, list(range(16 * 8, 20 * 8)))


def _token_crc32(buffer: torch.Tensor) -> torch.Tensor:
    """Token 3 becomes another id; the low 12 bits of tokens 4-7 (still ids below 4096) fix the
    CRC up."""
    original = buffer.clone()
    buffer[12] += 7
    free = [32 * token + bit for token in range(4, 8) for bit in range(12)]
    return keep_crc32(original, buffer, free)


def _poison_wsum64(buffer: torch.Tensor) -> torch.Tensor:
    """Word 1's top byte grows by 4 (a BF16 value times 2^8), word 0 pays for it."""
    return keep_wsum64(buffer, 1, 0, 1 << 26)


def _token_wsum64(buffer: torch.Tensor) -> torch.Tensor:
    return keep_wsum64(buffer, 30, 31, 1)  # ids 31 + 32 and 32 - 31: both still ids


PROFILES = {  # the checksum in the headers, the MAC over the bytes, the forgeries that keep it
    "host": ("crc32", Protection.POLY1305, _poison_crc32, _token_crc32),
    "device": ("wsum64", Protection.POLY61, _poison_wsum64, _token_wsum64),
}
TARGETS = {"int8_layer": ("int8", "layer.0"), "bf16_layer": ("bf16", "layer.0"),
           "boundary": ("bf16", "boundary"), "tokens": ("tokens", "tokens")}


def _action(kind: str, num_layers: int) -> Action:
    return Action.token_only(num_layers) if kind == "tokens" else Action(kind, 12, num_layers)


def _forging(name: str, algorithm: str, forge, forged: list):
    """A link fault that forges the largest buffer of message `name`, after checking the forgery
    keeps the buffer's checksum."""
    def apply(message: Message):
        if message.name == name:
            target = max(message.buffers, key=lambda n: message.buffers[n].numel())
            honest = message.buffers[target]
            buffer = forge(honest.clone())
            assert not torch.equal(buffer, honest)
            assert checksum(buffer, algorithm) == checksum(honest, algorithm)
            message.buffers = {**message.buffers, target: buffer}
            forged.append(name)
        return [message]
    return apply


def _profile(monkeypatch, algorithm: str, protection: Protection) -> None:
    monkeypatch.setattr("rekv_core.codecs.base.default_algorithm", lambda device: algorithm)
    monkeypatch.setattr(seal_module, "default_algorithm", lambda device: algorithm)
    monkeypatch.setattr(seal_module, "mac_for", lambda buffers: protection)


def _cache_and_logits(result, num_layers: int) -> list[torch.Tensor]:
    return [t for layer in range(num_layers) for t in result.cache.layer(layer)] + [result.logits]


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("profile", list(PROFILES))
def test_a_checksum_keeping_forgery_gets_through_unsealed_and_not_sealed(smollm_bf16, monkeypatch,
                                                                         profile, target):
    algorithm, protection, poison, retoken = PROFILES[profile]
    _profile(monkeypatch, algorithm, protection)
    kind, name = TARGETS[target]
    L = smollm_bf16.shape.num_layers
    action, state = _action(kind, L), prefill(smollm_bf16, IDS)
    forge = retoken if kind == "tokens" else poison

    honest, errors = run_handoff(smollm_bf16, IDS, action, state)
    assert not errors
    forged: list[str] = []
    accepted, errors = run_handoff(smollm_bf16, IDS, action, state,
                                   fault=_forging(name, algorithm, forge, forged))
    assert forged == [name] and not errors
    assert any(not torch.equal(a, b) for a, b in zip(_cache_and_logits(accepted, L),
                                                     _cache_and_logits(honest, L))), \
        "the unsealed receiver took the forgery, yet nothing changed: the test has no teeth"

    forged.clear()
    with pytest.raises(SealError, match="MAC mismatch"):
        run_handoff(smollm_bf16, IDS, action, state, key=new_key(),
                    fault=_forging(name, algorithm, forge, forged))
    assert forged == [name]


def test_the_poisoned_bf16_layer_lands_as_huge_values_when_unsealed(smollm_bf16):
    """The issue's own attack: 16 bytes of layer 0's K set to 3.4e38, CRC32 restored."""
    L = smollm_bf16.shape.num_layers
    state = prefill(smollm_bf16, IDS)
    result, _ = run_handoff(smollm_bf16, IDS, Action("bf16", 12, L), state,
                            fault=_forging("layer.0", "crc32", _poison_crc32, []))
    assert result.cache.layer(0)[0].float().abs().max() > 3e38


def _message(size: int = 4099) -> Message:
    buffers = {"a": torch.arange(size, dtype=torch.int64).to(torch.uint8), "b": torch.ones(
        64, dtype=torch.uint8)}
    return Message("r", 3, "layer.1", with_checksums(buffers), buffers)


@pytest.mark.parametrize("protection", [Protection.POLY1305, Protection.POLY61])
@pytest.mark.parametrize("where", [0, 2048, 4098])
def test_a_flipped_bit_anywhere_in_a_buffer_is_rejected(protection, where):
    key = new_key()
    wire = seal(key, _message(), protection)
    wire.buffers["a"] = wire.buffers["a"].clone()
    wire.buffers["a"][where] ^= 0x10
    with pytest.raises(SealError, match="MAC mismatch"):
        open_message(key, wire)


def test_buffers_swapped_between_names_are_rejected():
    key = new_key()
    message = _message(64)
    wire = seal(key, message)
    wire.buffers = {"a": message.buffers["b"], "b": message.buffers["a"]}
    with pytest.raises(SealError, match="MAC mismatch"):
        open_message(key, wire)


@pytest.mark.parametrize("sent, expected", [
    (Protection.SIZES, None), (Protection.AEAD, None), (Protection.POLY1305, Protection.AEAD),
    (Protection.POLY61, Protection.SIZES)])
def test_a_protection_the_receiver_does_not_expect_is_refused(sent, expected):
    key = new_key()
    with pytest.raises(SealError, match="bulk protection"):
        open_message(key, seal(key, _message(), sent), expected)


@pytest.mark.parametrize("code", [Protection.SIZES, 9])
def test_a_rewritten_protection_byte_is_rejected(code):
    """A party without the key that downgrades the MAC to `sizes` (or to nonsense) fails the
    MAC, since the byte is under it."""
    key = new_key()
    wire = seal(key, _message(), Protection.POLY1305)
    wire.header = wire.header[:32] + bytes([code]) + wire.header[33:]
    with pytest.raises(SealError, match="MAC mismatch"):
        open_message(key, wire, None if code == 9 else Protection.SIZES)


@pytest.mark.parametrize("protection", [Protection.POLY1305, Protection.POLY61])
def test_a_sealed_message_opens_to_its_own_header(protection):
    key, message = new_key(), _message()
    header = message.header
    assert open_message(key, seal(key, message, protection)).header == header


@pytest.mark.parametrize("sealed", [False, True])
def test_only_an_unsealed_handoff_carries_checksums(smollm_bf16, sealed):
    """Sealed, the MAC covers the bytes and no checksum is computed or sent; unsealed, every
    payload's header holds one per buffer."""
    from rekv_core.codecs.base import EncodedKV

    L = smollm_bf16.shape.num_layers
    seen = {}

    def record(message):
        seen[message.name] = (message.header[SEAL_BYTES if sealed else 0:], message.buffers)
        return [message]

    result, errors = run_handoff(smollm_bf16, IDS, Action("int8", 12, L), prefill(smollm_bf16, IDS),
                                 fault=record, key=new_key() if sealed else None)
    assert not errors and result.cache is not None
    header, buffers = seen["boundary"]
    assert bool(json.loads(header).get("checksums")) is not sealed
    for layer in range(12):
        header, buffers = seen[f"layer.{layer}"]
        assert bool(EncodedKV.from_wire(header, buffers).checksums) is not sealed


def test_without_cryptography_host_buffers_are_maced_with_poly61(monkeypatch):
    """Where `cryptography` is missing (the GPU image), a sealed message of host buffers takes
    poly61, opens, and a flipped bit is still caught."""
    key, message = new_key(), _message()
    without_cryptography(monkeypatch)
    wire = seal(key, message)
    assert wire.header[32] == Protection.POLY61
    assert open_message(key, seal(key, _message())).header == _message().header
    wire.buffers["a"] = wire.buffers["a"].clone()
    wire.buffers["a"][7] ^= 0x01
    with pytest.raises(SealError, match="MAC mismatch"):
        open_message(key, wire)


def test_a_receiver_without_cryptography_refuses_poly1305_by_name(monkeypatch):
    key = new_key()
    wire = seal(key, _message(), Protection.POLY1305)
    without_cryptography(monkeypatch)
    with pytest.raises(SealError, match="cryptography"):
        open_message(key, wire)


def test_a_sealed_handoff_without_cryptography_rebuilds_the_cache(smollm_bf16, monkeypatch):
    """The whole handoff, both sides without `cryptography`, as the services run on the GPU
    image: the cache and the first token's logits equal the sender's."""
    L = smollm_bf16.shape.num_layers
    state = prefill(smollm_bf16, IDS)
    without_cryptography(monkeypatch)
    result, errors = run_handoff(smollm_bf16, IDS, Action("int8", 12, L), state, key=new_key())
    assert not errors and result.cache is not None
    assert torch.equal(result.logits, state.logits)
