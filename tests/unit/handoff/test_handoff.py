"""The in-process handoff end to end: every action rebuilds the sender's cache (bit-exact where it
is BF16 or recomputed, within the quantizer's bound otherwise), counts the bytes of the byte model,
and fails loudly on a broken stream without leaving threads or buffers behind."""

import threading
import time

import pytest
import torch

from rekv_core.handoff import (Action, ActionKind, ReceiveMode, Receiving, receive_handoff,
                               send_handoff, wire_bytes)
from rekv_core.handoff.transfer import Transfer
from rekv_core.model import prefill
from rekv_core.transport import TransportError
from rekv_core.transport.inprocess import InProcessLink
from tests.support.inprocess_handoff import planned

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def _actions(L):
    return [Action.full_bf16(L), Action("int8", L, L), Action("int4", L, L),
            Action("bf16", 11, L), Action.token_only(L), Action("int8", 11, L),
            Action("int8", 1, L), Action("int4", L - 1, L)]


def _handoff(model, ids, action, mode=ReceiveMode.OVERLAP, fault=None, request_id="r1",
             timeout=30.0):
    state = prefill(model, ids)
    plan, source = planned(model, ids, action, state)
    with InProcessLink(fault=fault) as link:
        link.receiver.open(request_id)
        errors = []

        def send():
            try:
                send_handoff(link.sender, plan, source, Transfer(request_id))
            except Exception as exc:  # noqa: BLE001 - surfaced by the test
                errors.append(exc)

        sender = threading.Thread(target=send)
        sender.start()
        try:
            result = receive_handoff(model, link.receiver, Transfer(request_id, stall_s=timeout),
                                     receiving=Receiving(mode))
        finally:
            sender.join()
            assert link.receiver.pending().idle
    return state, result, errors


@pytest.mark.parametrize("mode", list(ReceiveMode))
def test_every_action_rebuilds_the_cache(smollm_bf16, tokenizer, mode):
    model = smollm_bf16
    ids = tokenizer.encode(PROMPT)
    L = model.shape.num_layers
    for action in _actions(L):
        state, result, errors = _handoff(model, ids, action, mode)
        assert not errors
        assert result.bytes == wire_bytes(action, model.shape, len(ids)), str(action)
        assert result.cache.length == len(ids)
        for layer in range(L):
            k, v = result.cache.layer(layer)
            exact = layer >= action.cut or action.codec == "bf16" or action.cut == 0
            if exact:
                assert torch.equal(k, state.keys[layer]), f"{action}: K of layer {layer}"
                assert torch.equal(v, state.values[layer]), f"{action}: V of layer {layer}"
            else:
                qmax = 127 if action.codec == "int8" else 7
                for got, ref in ((k, state.keys[layer]), (v, state.values[layer])):
                    step = ref.float().reshape(-1, 64).abs().amax(1, keepdim=True) / qmax
                    err = (got.float() - ref.float()).reshape(-1, 64).abs()
                    assert (err <= step / 2 + got.float().abs().reshape(-1, 64) / 256).all()
        if action.kind in (ActionKind.BF16_TRANSFER, ActionKind.BF16_RECOMPUTE,
                           ActionKind.TOKEN_RECOMPUTE):
            assert torch.equal(result.logits, state.logits), str(action)
        if action.kind is ActionKind.JOINT and action.codec == "int8":
            assert result.logits.argmax() == state.logits.argmax(), str(action)
        t = result.timings  # eq. 9's structure: the join follows the later of the two branches
        assert min(t.h_s, t.x_s, t.r_s, t.j_s) >= 0
        assert t.total_s >= t.h_s + max(t.x_s, t.r_s) + t.j_s - 1e-9, str(action)
        # the suffix's span (what the decode load is averaged over) holds its compute
        if not (action.sends_boundary or action.kind is ActionKind.TOKEN_RECOMPUTE):
            assert t.suffix_end_s == 0.0, str(action)
        else:
            assert t.h_s + t.r_s - 1e-9 <= t.suffix_end_s <= t.total_s - t.j_s + 1e-9, str(action)


def _fault(kind):
    def apply(message):
        if message.name != "layer.3":
            return [message]
        if kind == "drop":
            return []
        if kind == "duplicate":
            return [message, message]
        if kind == "truncate":
            name = next(iter(message.buffers))
            message.buffers[name] = message.buffers[name][:-1]
            return [message]
        if kind == "corrupt":
            name = next(iter(message.buffers))
            message.buffers[name][0] ^= 0x40
            return [message]
        if kind == "misroute":
            message.request_id = "someone-else"
            return [message]
        raise AssertionError(kind)
    return apply


@pytest.mark.parametrize("kind, error", [
    ("drop", (TransportError, TimeoutError)), ("duplicate", TransportError),
    ("truncate", ValueError), ("corrupt", ValueError), ("misroute", (TransportError, TimeoutError)),
])
def test_broken_streams_fail_without_a_cache(smollm_bf16, kind, error):
    before = {t.name for t in threading.enumerate()}
    L = smollm_bf16.shape.num_layers
    with pytest.raises(error):
        _handoff(smollm_bf16, list(range(1, 40)), Action("int8", 12, L), fault=_fault(kind),
                 timeout=2.0)
    leftover = {t.name for t in threading.enumerate()} - before
    assert not leftover, leftover


def test_a_receive_mode_is_an_enum_not_a_string():
    with pytest.raises(ValueError, match="mode"):
        Receiving(mode="overlap")
    with pytest.raises(ValueError, match="extra_capacity"):
        Receiving(extra_capacity=-1)


class _Stamped:
    """An in-process receiver whose messages arrive as over a wire: the plan while the reader
    looked, every later one already waiting for it (a back-to-back run)."""

    def __init__(self, receiver):
        self.inner, self.landed = receiver, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def recv(self, request_id, timeout):
        from rekv_core.transport.arrivals import Arrival

        message = self.inner.recv(request_id, timeout)
        first = message.seq == 0
        message.arrival = Arrival(0.0, not first, 0.0 if not first else 1e-7,
                                  time.perf_counter(), message.nbytes)
        self.landed.append((message.name, message.nbytes))
        return message


@pytest.mark.parametrize("kind", ["bf16_transfer", "quant_transfer", "joint", "token_recompute"])
def test_the_link_sample_counts_what_landed_before_the_worker_computed(smollm_bf16, tokenizer,
                                                                       kind):
    model = smollm_bf16
    ids = tokenizer.encode(PROMPT)
    L = model.shape.num_layers
    action = {"bf16_transfer": Action.full_bf16(L), "quant_transfer": Action("int8", L, L),
              "joint": Action("int8", 11, L), "token_recompute": Action.token_only(L)}[kind]
    plan, source = planned(model, ids, action, prefill(model, ids))
    with InProcessLink() as link:
        link.receiver.open("timed")
        send_handoff(link.sender, plan, source, Transfer("timed"))
        stamped = _Stamped(link.receiver)
        result = receive_handoff(model, stamped, Transfer("timed"))
    sizes = dict(stamped.landed)
    after_plan = sum(n for name, n in stamped.landed if name != "plan")
    if kind == "bf16_transfer":  # copying BF16 layers is not computing: all of it counts
        assert result.link_sample[0] == after_plan
    elif kind == "quant_transfer":  # dequantizing layer 0 begins the computing
        assert result.link_sample[0] == sizes["layer.0"]
    elif kind == "joint":  # the suffix begins once h_c is in
        assert sizes["boundary"] <= result.link_sample[0] < after_plan
    else:
        assert result.link_sample is None


def test_a_cache_allocated_ahead_must_fit_the_plan(smollm_bf16, tokenizer):
    model = smollm_bf16
    ids = tokenizer.encode(PROMPT)
    state = prefill(model, ids)
    for action in (Action("int8", 11, model.shape.num_layers), Action.token_only(30)):
        with InProcessLink() as link:
            link.receiver.open("ahead")
            send_handoff(link.sender, *planned(model, ids, action, state), Transfer("ahead"))
            result = receive_handoff(model, link.receiver, Transfer("ahead"),
                                     receiving=Receiving(prompt_len=len(ids), extra_capacity=4))
        assert result.cache.capacity == len(ids) + 4 and result.cache.length == len(ids)
        assert torch.equal(result.cache.layer(29)[0], state.keys[29])
    with InProcessLink() as link:
        link.receiver.open("short")
        send_handoff(link.sender, *planned(model, ids, action, state), Transfer("short"))
        with pytest.raises(TransportError, match="plan"):
            receive_handoff(model, link.receiver, Transfer("short"),
                            receiving=Receiving(prompt_len=len(ids) - 1))
        assert link.receiver.pending().idle
