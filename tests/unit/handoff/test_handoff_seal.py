"""Sealed handoffs: with the handoff's key every action rebuilds the cache, and a message from
another handoff, for another request, without the key, or with flipped bytes is rejected before
anything is written into a cache."""

import threading

import pytest
import torch

from rekv_core.handoff import Action, Sealing, receive_handoff, send_handoff
from rekv_core.handoff.seal import SealError, new_key
from rekv_core.handoff.transfer import Transfer
from rekv_core.model import prefill
from rekv_core.transport import Message, TransportError
from rekv_core.transport.inprocess import InProcessLink
from tests.support.inprocess_handoff import planned

IDS = list(range(1, 41))


def _run(model, action, send_key, receive_key, fault=None, request_id="r1", state=None,
         send_binding=b"", receive_binding=b""):
    state = state or prefill(model, IDS)
    plan, source = planned(model, IDS, action, state)
    sealing = Sealing(send_key, binding=send_binding)  # a bad key is refused here, naming it
    with InProcessLink(fault=fault) as link:
        link.receiver.open(request_id)
        thread = threading.Thread(target=lambda: _quiet(send_handoff, link.sender, plan,
                                                        source, Transfer(request_id), sealing))
        thread.start()
        try:
            return state, receive_handoff(model, link.receiver,
                                          Transfer(request_id, stall_s=3.0),
                                          Sealing(receive_key, binding=receive_binding))
        finally:
            thread.join()


def _quiet(function, *args, **kwargs):
    try:
        function(*args, **kwargs)
    except (TransportError, TimeoutError, ValueError):
        pass  # the receiver's failure is what the test looks at


@pytest.mark.parametrize("action", ["full", "joint", "token"])
def test_sealed_handoffs_rebuild_the_cache(smollm_bf16, action):
    L = smollm_bf16.shape.num_layers
    action = {"full": Action.full_bf16(L), "joint": Action("bf16", 12, L),
              "token": Action.token_only(L)}[action]
    key = new_key()
    state, result = _run(smollm_bf16, action, key, key)
    for layer in range(L):
        assert torch.equal(result.cache.layer(layer)[0], state.keys[layer])
    assert torch.equal(result.logits, state.logits)


@pytest.mark.parametrize("send_key", [None, "other"])
def test_a_sender_without_the_key_cannot_inject(smollm_bf16, send_key):
    L = smollm_bf16.shape.num_layers
    key = new_key()
    with pytest.raises(SealError, match="MAC"):
        _run(smollm_bf16, Action("int8", 12, L), new_key() if send_key else None, key)


def _replay_from(earlier: dict):
    """A fault that replaces layer.3 with the same message of an earlier handoff."""
    def apply(message: Message):
        if message.name == "layer.3":
            old = earlier["layer.3"]
            return [Message(message.request_id, message.seq, old.name, old.header, old.buffers)]
        return [message]
    return apply


def test_a_replayed_message_of_an_earlier_handoff_is_rejected(smollm_bf16):
    L = smollm_bf16.shape.num_layers
    action, state = Action("int8", 12, L), prefill(smollm_bf16, IDS)
    recorded = {}

    def record(message):
        recorded[message.name] = message
        return [message]

    _run(smollm_bf16, action, key := new_key(), key, fault=record, state=state)
    with pytest.raises(SealError, match="MAC"):
        _run(smollm_bf16, action, key2 := new_key(), key2, fault=_replay_from(recorded),
             state=state)


def test_a_message_for_another_request_is_rejected(smollm_bf16):
    L = smollm_bf16.shape.num_layers
    key = new_key()

    def misdirect(message):  # sealed for "elsewhere", delivered to "r1"
        message.request_id = "r1"
        return [message]

    with InProcessLink(fault=misdirect) as link:
        state = prefill(smollm_bf16, IDS)
        link.receiver.open("r1")
        plan, source = planned(smollm_bf16, IDS, Action("bf16", 12, L), state)
        thread = threading.Thread(target=lambda: _quiet(
            send_handoff, link.sender, plan, source, Transfer("elsewhere"), Sealing(key)))
        thread.start()
        try:
            with pytest.raises(SealError, match="MAC"):
                receive_handoff(smollm_bf16, link.receiver, Transfer("r1", stall_s=3),
                                Sealing(key))
        finally:
            thread.join()


@pytest.mark.parametrize("key, error", [(None, "checksum mismatch"), ("sealed", "MAC mismatch")])
def test_a_flipped_boundary_byte_is_caught(smollm_bf16, key, error):
    """Unsealed, the checksum catches it; sealed, the MAC over the bytes does, first."""
    L = smollm_bf16.shape.num_layers
    key = new_key() if key else None

    def flip(message):
        if message.name == "boundary":
            message.buffers["h"][100] ^= 0x01
        return [message]

    with pytest.raises(SealError, match=error):
        _run(smollm_bf16, Action("bf16", 12, L), key, key, fault=flip)


def test_a_key_of_the_wrong_size_is_named(smollm_bf16):
    with pytest.raises(ValueError, match="handoff_key"):
        _run(smollm_bf16, Action.full_bf16(smollm_bf16.shape.num_layers), b"short", b"short")


def test_a_message_sealed_for_another_binding_does_not_verify():
    """The binding (the model's fingerprint) goes into every message key: the same handoff key
    with another binding is another key, and no binding keeps the key as it is."""
    from rekv_core.handoff.seal import open_message, seal

    key = new_key()
    assert Sealing(key).message_key == key
    mine, theirs = Sealing(key, binding=b"model-a"), Sealing(key, binding=b"model-b")
    assert mine.message_key not in (key, theirs.message_key)

    def message():
        return Message("r", 0, "plan", b"{}", {"x": torch.arange(8, dtype=torch.uint8)})

    assert open_message(mine.message_key, seal(mine.message_key, message())).header == b"{}"
    with pytest.raises(SealError, match="MAC"):
        open_message(theirs.message_key, seal(mine.message_key, message()))


def test_a_handoff_sealed_for_another_model_fingerprint_does_not_verify(smollm_bf16):
    """The prefill side seals under the fingerprint of the model it ran: a decode worker of
    another model rejects the first message, before anything reaches its cache; the same
    fingerprint on both sides rebuilds the cache."""
    L = smollm_bf16.shape.num_layers
    key, theirs, mine = new_key(), bytes.fromhex("aa" * 32), bytes.fromhex("bb" * 32)
    with pytest.raises(SealError, match="plan: handoff MAC mismatch"):
        _run(smollm_bf16, Action("bf16", 12, L), key, key, send_binding=theirs,
             receive_binding=mine)
    state, result = _run(smollm_bf16, Action("bf16", 12, L), key, key, send_binding=mine,
                         receive_binding=mine)
    assert torch.equal(result.logits, state.logits)
