"""Recovering a failed handoff by recomputing only what it lost (`handoff.recovery`).

When only prefix layers fail (a flipped bit in a late layer, layers held past the deadline, a
sender that dies mid-prefix), the receiver keeps every verified layer and the suffix, and layers
0..m recomputed from the token ids complete a cache bit-identical to the single-process prefill's
on the lossless actions (and, on a lossy one, the codec's layers above m as a whole handoff would
have them); when the boundary, the token ids or the plan is in doubt, nothing is salvaged and the
whole prompt is recomputed."""

import threading

import pytest
import torch

from rekv_core.codecs import get_codec
from rekv_core.handoff import Action, ReceiveMode, Receiving
from rekv_core.handoff.recovery import (FULL, PARTIAL, PartialHandoff, Salvage, recompute_lost,
                                        recovery)
from rekv_core.handoff.seal import SealError, new_key
from rekv_core.handoff.source import ChunkedPrefill, LivePrefill
from rekv_core.handoff.transfer import Transfer
from rekv_core.model import prefill
from rekv_core.transport import TransportError
from tests.support.inprocess_handoff import run_handoff

L = 30
IDS = list(range(1, 41))
KEEP = Receiving(keep_verified=True)
HOLD_S = 8.0  # a held sender: well past the receiver's 1.5 s stall limit, however loaded the machine


def _flip(name):
    """A link fault: one bit of `name`'s first buffer flipped on the wire."""
    def apply(message):
        if message.name == name:
            buffer = next(iter(message.buffers.values()))
            buffer[buffer.numel() // 2] ^= 0x10
        return [message]
    return apply


def _salvage(model, ids, action, source=None, chunk_tokens=0, receiving=KEEP, **kwargs):
    """The `PartialHandoff` a handoff with a fault raises, and the sender's errors."""
    source = prefill(model, ids) if source is None else source
    with pytest.raises(PartialHandoff) as raised:
        run_handoff(model, ids, action, source, chunk_tokens, receiving, **kwargs)
    return raised.value


def _assert_reference(model, ids, salvage, lossy_codec=None):
    """Recompute what was lost: every layer is the prefill's (a lossy codec's above m: what it
    makes of the prefill's layer), and so are the first logits where the suffix is exact."""
    ref = prefill(model, ids)
    decided = recovery(salvage, ids, L)
    assert decided.scope == PARTIAL and decided.layers == salvage.lost[-1] + 1
    cache = recompute_lost(model, ids, salvage)
    assert cache.length == len(ids)
    codec = get_codec(lossy_codec) if lossy_codec else None
    for layer in range(L):
        k, v = cache.layer(layer)
        if codec is not None and decided.layers <= layer < salvage.plan.action.cut:
            rk, rv = codec.decode(codec.encode(ref.keys[layer], ref.values[layer]))
            rk, rv = rk.to(k.dtype), rv.to(v.dtype)
        else:
            rk, rv = ref.keys[layer], ref.values[layer]
        assert torch.equal(k, rk) and torch.equal(v, rv), f"layer {layer}"
    assert torch.equal(salvage.logits, ref.logits)


@pytest.mark.parametrize("mode", list(ReceiveMode))
def test_a_flipped_bit_in_a_late_layer_recomputes_up_to_it(smollm_bf16, mode):
    key = new_key()
    partial = _salvage(smollm_bf16, IDS, Action("bf16", 12, L), fault=_flip("layer.9"),
                       receiving=Receiving(mode, keep_verified=True), key=key)
    assert isinstance(partial.cause, (SealError, ValueError)), partial.cause
    assert partial.salvage.lost == [9]
    assert partial.salvage.verified == frozenset(range(12)) - {9}
    _assert_reference(smollm_bf16, IDS, partial.salvage)


def _flip_header(name):
    """A link fault: one bit of `name`'s sealed header flipped (its MAC no longer holds)."""
    def apply(message):
        if message.name == name:
            header = bytearray(message.header)
            header[len(header) // 2] ^= 0x10
            message.header = bytes(header)
        return [message]
    return apply


@pytest.mark.parametrize("how", ["header", "ciphertext"])
def test_a_late_layer_failing_its_seal_recomputes_up_to_it(smollm_bf16, how):
    """The MAC (or, encrypted, the cipher's tag) refuses the message: it counts as the layer it
    claims to be, which is next in its order, and the reading goes on."""
    fault = _flip_header("layer.9") if how == "header" else _flip("layer.9")
    partial = _salvage(smollm_bf16, IDS, Action("bf16", 12, L), fault=fault, key=new_key(),
                       encrypted=how == "ciphertext")
    assert isinstance(partial.cause, SealError), partial.cause
    assert partial.salvage.lost == [9]
    _assert_reference(smollm_bf16, IDS, partial.salvage)


def test_a_refused_message_claiming_a_boundary_salvages_nothing(smollm_bf16):
    with pytest.raises(SealError) as raised:
        run_handoff(smollm_bf16, IDS, Action("bf16", 12, L), prefill(smollm_bf16, IDS),
                    receiving=KEEP, fault=_flip_header("boundary"), key=new_key())
    assert not isinstance(raised.value, PartialHandoff)


def test_a_lossy_prefix_keeps_its_decoded_layers(smollm_bf16):
    partial = _salvage(smollm_bf16, IDS, Action("int8", 12, L), fault=_flip("layer.6"))
    assert partial.salvage.lost == [6]
    _assert_reference(smollm_bf16, IDS, partial.salvage, lossy_codec="int8")


class _StopAfter:
    """Send hooks: after `name` is posted, hold the sender for `hold_s` (a held prefix), or, with
    `die`, fail it (a prefill that dies mid-prefix: nothing more is sent)."""

    def __init__(self, name, hold_s=0.0, die=False):
        self.name, self.hold_s, self.die = name, hold_s, die
        self.released = threading.Event()

    def before_send(self, message):
        return message

    def after_send(self, name):
        if name == self.name:
            if self.die:
                raise ConnectionError("the prefill died")
            self.released.wait(self.hold_s)


def test_a_prefix_held_past_the_deadline_keeps_the_layers_in(smollm_bf16):
    """The seed's schedule sends the boundary first, then layers 0..c-1: held after half of
    them, the rest are missing when the receiver's time is up."""
    hold = _StopAfter("layer.5", hold_s=HOLD_S)
    try:
        partial = _salvage(smollm_bf16, IDS, Action("bf16", 12, L), hooks=hold,
                           receive_transfer=Transfer("r", stall_s=1.5))
    finally:
        hold.released.set()
    assert isinstance(partial.cause, (TimeoutError, TransportError)), partial.cause
    assert partial.salvage.lost == list(range(6, 12))
    _assert_reference(smollm_bf16, IDS, partial.salvage)


def test_a_stream_cut_short_mid_prefix_recovers_partially(smollm_bf16):
    partial = _salvage(smollm_bf16, IDS, Action("bf16", 20, L), hooks=_StopAfter(
        "layer.13", die=True), receive_transfer=Transfer("r", stall_s=1.5))
    assert partial.salvage.lost == list(range(14, 20))
    _assert_reference(smollm_bf16, IDS, partial.salvage)


def test_transfer_only_recovers_from_its_verified_head(smollm_bf16):
    partial = _salvage(smollm_bf16, IDS, Action.full_bf16(L), fault=_flip("layer.27"))
    assert partial.salvage.lost == [27]
    _assert_reference(smollm_bf16, IDS, partial.salvage)


def test_streamed_and_pipelined_schedules_recover_a_late_layer(smollm_bf16):
    ids = torch.randint(0, 49152, (520,), generator=torch.Generator().manual_seed(5)).tolist()
    action = Action("bf16", 10, L)
    streamed = _salvage(smollm_bf16, ids, action, LivePrefill(smollm_bf16, ids, 10), 256,
                        fault=_flip("layer.8"))
    assert streamed.salvage.lost == [8]
    _assert_reference(smollm_bf16, ids, streamed.salvage)
    pipelined = _salvage(smollm_bf16, ids, action, ChunkedPrefill(smollm_bf16, ids, 10, 256),
                         256, fault=_flip("layer.8.1"))  # the second row chunk of layer 8
    assert pipelined.salvage.lost == [8]
    _assert_reference(smollm_bf16, ids, pipelined.salvage)


@pytest.mark.parametrize("what", ["boundary", "token ids", "streamed prefix held"])
def test_a_boundary_or_token_ids_in_doubt_salvage_nothing(smollm_bf16, what):
    """The failure itself is raised: the caller recomputes everything."""
    ids, kwargs = IDS, {}
    if what == "boundary":
        action, kwargs = Action("bf16", 12, L), {"fault": _flip("boundary")}
    elif what == "token ids":
        action, kwargs = Action.token_only(L), {"fault": _flip("tokens")}
    else:  # a streamed boundary follows the whole prefix: held mid-prefix, it never comes
        action = Action("bf16", 12, L)
        kwargs = {"source": LivePrefill(smollm_bf16, ids, 12),
                  "hooks": _StopAfter("layer.5", hold_s=HOLD_S),
                  "receive_transfer": Transfer("r", stall_s=1.5)}
    source = kwargs.pop("source", prefill(smollm_bf16, ids))
    try:
        with pytest.raises((TransportError, ValueError, TimeoutError)) as raised:
            run_handoff(smollm_bf16, ids, action, source, 0, KEEP, **kwargs)
    finally:
        if "hooks" in kwargs:
            kwargs["hooks"].released.set()
    assert not isinstance(raised.value, PartialHandoff)


def test_without_keep_verified_a_lost_layer_fails_the_handoff(smollm_bf16):
    with pytest.raises((SealError, ValueError)) as raised:
        run_handoff(smollm_bf16, IDS, Action("bf16", 12, L), prefill(smollm_bf16, IDS),
                    fault=_flip("layer.9"))
    assert not isinstance(raised.value, PartialHandoff)


def test_the_decision(smollm_bf16):
    partial = _salvage(smollm_bf16, IDS, Action("bf16", 12, L), fault=_flip("layer.3"))
    salvage = partial.salvage
    assert recovery(salvage, IDS, L).layers == 4
    assert recovery(None, IDS, L).scope == FULL and recovery(None, IDS, L).layers == L
    assert recovery(salvage, IDS[:-1], L).scope == FULL  # the plan was for other token ids
    whole = Salvage(salvage.plan, salvage.cache, salvage.logits, frozenset(range(12)))
    assert recovery(whole, IDS, L).scope == FULL  # nothing lost: nothing to salvage from
    with pytest.raises(ValueError, match="ids"):
        recompute_lost(smollm_bf16, IDS[:-1], salvage)
