"""Every action of the handoff on every device this machine has, under every schedule, over the
in-process link and over UCX: the rebuilt cache is bit-exact against the sender's own encoding and
the byte model holds.

The CUDA cases (marker `cuda`, skipped without a GPU) are the ones that can see a cross-stream race:
the prompt is long enough that the suffix recompute is still queued on the compute stream while
the link copies and the prefix thread restores, so a copy or a read that skipped its `ready` event
shows up as a checksum failure or a wrong cache. The CPU cases run the same checks at a small size,
so this module's logic is exercised in CI too."""

import threading

import pytest
import torch

from rekv_core.codecs import get_codec
from rekv_core.handoff import (Action, ReceiveMode, Receiving, Sealing, receive_handoff,
                               send_handoff, wire_bytes)
from rekv_core.handoff.seal import new_key
from rekv_core.handoff.source import ChunkedPrefill, LivePrefill
from rekv_core.handoff.transfer import Transfer
from rekv_core.model import Model, prefill
from rekv_core.model.blocks import EXEC_BLOCK
from rekv_core.model.shapes import get_preset
from rekv_core.model.weights import synthetic_weights
from rekv_core.transport.inprocess import InProcessLink
from tests.support.inprocess_handoff import planned
from tests.support.requires import require

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])]
# (preset, prompt length): big enough on CUDA that the suffix is queued while the prefix lands
SIZES = {"cpu": ("smollm2-135m", 96), "cuda": ("qwen2.5-3b", 4096)}


@pytest.fixture(scope="module", params=DEVICES)
def setting(request):
    device = torch.device(request.param)
    preset, length = SIZES[request.param]
    shape = get_preset(preset)
    model = Model(synthetic_weights(shape, torch.bfloat16, device, shared_layer=True))
    ids = torch.randint(0, shape.vocab_size, (length,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    return model, ids, prefill(model, ids)


def _actions(L: int) -> list[Action]:
    cuts = sorted({1, L // 3, 2 * L // 3, L - 1})
    actions = [Action.full_bf16(L), Action("int8", L, L), Action("int4", L, L),
               Action.token_only(L)]
    return actions + [Action(codec, c, L) for codec in ("bf16", "int8", "int4") for c in cuts]


def _expected_layer(state, action: Action, layer: int):
    k, v = state.keys[layer], state.values[layer]
    if layer >= action.cut or action.cut == 0 or action.codec == "bf16":
        return k, v
    codec = get_codec(action.codec)
    return codec.decode(codec.encode(k, v))


def _handoff(model, ids, state, action, mode, sender, receiver, request_id, streamed=False,
             chunk_tokens=0, pipelined=False):
    receiver.open(request_id)
    errors = []
    key = new_key()  # sealed as in the services: the MAC and checksums run on the device too

    def send():
        source = LivePrefill(model, ids, action.cut) if streamed else state
        if pipelined:
            source = ChunkedPrefill(model, ids, action.cut, chunk_tokens)
        try:
            send_handoff(sender, *planned(model, ids, action, source, chunk_tokens),
                         Transfer(request_id), Sealing(key))
        except Exception as exc:  # noqa: BLE001 - surfaced by the test
            errors.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        return receive_handoff(model, receiver, Transfer(request_id, stall_s=60), Sealing(key),
                               Receiving(mode))
    finally:
        thread.join()
        assert not errors, errors


def _check(model, ids, state, action, result):
    assert result.bytes == wire_bytes(action, model.shape, len(ids)), str(action)
    assert result.cache.length == len(ids)
    for layer in range(model.shape.num_layers):
        k, v = result.cache.layer(layer)
        want_k, want_v = _expected_layer(state, action, layer)
        assert torch.equal(k, want_k) and torch.equal(v, want_v), f"{action}: layer {layer}"
    if action.lossless:
        assert torch.equal(result.logits, state.logits), str(action)


@pytest.mark.parametrize("mode", list(ReceiveMode))
def test_every_action_is_exact_over_the_inprocess_link(setting, mode):
    model, ids, state = setting
    # a finite rate keeps messages on the wire while the suffix computes
    link_gbps = 400.0 if model.device.type == "cuda" else None
    with InProcessLink(bandwidth_gbps=link_gbps) as link:
        for n, action in enumerate(_actions(model.shape.num_layers)):
            result = _handoff(model, ids, state, action, mode, link.sender, link.receiver,
                              f"{mode.value}-{n}")
            _check(model, ids, state, action, result)
        assert link.receiver.pending().idle


def test_every_action_is_exact_streamed_with_a_chunked_boundary(setting):
    """The prefill runs on the compute stream while the sender encodes each layer on its own
    stream after that layer's compute; the suffix runs one boundary chunk at a time."""
    model, ids, state = setting
    link_gbps = 400.0 if model.device.type == "cuda" else None
    with InProcessLink(bandwidth_gbps=link_gbps) as link:
        for n, action in enumerate(_actions(model.shape.num_layers)):
            result = _handoff(model, ids, state, action, ReceiveMode.OVERLAP, link.sender,
                              link.receiver, f"streamed-{n}", streamed=True,
                              chunk_tokens=EXEC_BLOCK)
            assert result.plan.streamed
            _check(model, ids, state, action, result)
        assert link.receiver.pending().idle


def test_every_interior_cut_is_exact_pipelined(setting):
    """The prefill runs one token chunk at a time on the compute stream while the sender encodes
    each chunk's boundary and prefix rows on its own stream; on CUDA 16 chunks, each chunk's
    suffix queued while later chunks compute and land."""
    model, ids, state = setting
    link_gbps = 400.0 if model.device.type == "cuda" else None
    L = model.shape.num_layers
    with InProcessLink(bandwidth_gbps=link_gbps) as link:
        for n, action in enumerate(a for a in _actions(L) if 0 < a.cut < L):
            result = _handoff(model, ids, state, action, ReceiveMode.OVERLAP, link.sender,
                              link.receiver, f"pipelined-{n}", chunk_tokens=EXEC_BLOCK,
                              pipelined=True)
            assert result.plan.pipelined
            _check(model, ids, state, action, result)
        assert link.receiver.pending().idle


def test_every_action_is_exact_over_ucx(setting):
    require("ucxx")
    from rekv_core.transport.ucx import UcxEngine, UcxReceiver, UcxSender

    model, ids, state = setting
    engine = UcxEngine()
    receiver = UcxReceiver(engine, device=model.device, drain_seconds=0.5)
    sender = UcxSender(engine, receiver.address)
    try:
        for n, action in enumerate(_actions(model.shape.num_layers)):
            result = _handoff(model, ids, state, action, ReceiveMode.OVERLAP, sender, receiver,
                              f"ucx-{n}")
            _check(model, ids, state, action, result)
    finally:
        sender.shutdown()
        receiver.shutdown()
        engine.close()
