"""Pipelined handoffs: the prefill runs in the boundary's token chunks up to the cut
(`ChunkedPrefill`), and each chunk's boundary rows, then its prefix rows, leave once it has
passed the cut.

The lossless actions rebuild the single-process prefill's cache and first-token logits bit for bit,
for several chunk sizes and prompt lengths; a lossy codec's rows are exactly what it makes of the
whole layer (its groups lie along head_dim, so a chunk encodes alone as it would in the layer);
the messages go in token order; the prefill computes only the layers below the cut, and releases
its compute once; what cannot be pipelined is refused by name; the receiver refuses a layer's rows
out of their order."""


import pytest
import torch

from rekv_core.codecs import get_codec
from rekv_core.handoff import (Action, Delivery, HandoffPlan, Order, ReceiveMode, Receiving,
                               send_handoff, wire_bytes)
from rekv_core.handoff.seal import SealError, new_key
from rekv_core.handoff.source import ChunkedPrefill
from rekv_core.handoff.transfer import Transfer
from rekv_core.model import executor, prefill
from rekv_core.transport import TransportError
from rekv_core.transport.inprocess import InProcessLink
from tests.support.inprocess_handoff import MessageNames, run_handoff


def _ids(n, seed=0):
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _pipelined(model, ids, action, chunk_tokens, mode=ReceiveMode.OVERLAP, on_done=None,
               hooks=None, fault=None):
    source = ChunkedPrefill(model, ids, action.cut, chunk_tokens, on_done=on_done)
    result, errors = run_handoff(model, ids, action, source, chunk_tokens, Receiving(mode),
                                 hooks=hooks, fault=fault)
    return source, result, errors


@pytest.mark.parametrize("codec,cut,chunk,seq_len", [
    ("bf16", 11, 256, 520), ("bf16", 11, 256, 800), ("bf16", 1, 512, 1100), ("bf16", 29, 256, 600),
    ("splitzip", 15, 256, 600), ("int8", 11, 256, 800), ("int4", 20, 256, 520),
    ("int4h", 7, 512, 1100)])
def test_pipelined_handoff_rebuilds_the_cache(smollm_bf16, codec, cut, chunk, seq_len):
    model = smollm_bf16  # BF16 on the wire is exact for a BF16 model
    L = model.shape.num_layers
    ids = _ids(seq_len, seed=cut)
    action = Action(codec, cut, L)
    ref = prefill(model, ids)
    codec_ = get_codec(codec)
    for mode in list(ReceiveMode) if codec == "int8" else [ReceiveMode.OVERLAP]:
        _, result, errors = _pipelined(model, ids, action, chunk, mode)
        assert not errors
        assert result.plan.streamed
        if codec_.lossless:
            assert result.bytes.prefix + result.bytes.scales > 0
        else:  # same bytes as the layers whole: the groups lie along head_dim
            assert result.bytes == wire_bytes(action, model.shape, seq_len)
        for layer in range(L):
            k, v = result.cache.layer(layer)
            if layer >= cut or codec_.lossless:
                assert torch.equal(k, ref.keys[layer]) and torch.equal(v, ref.values[layer])
            else:  # exactly what the codec makes of the prefill's whole layer
                rk, rv = codec_.decode(codec_.encode(ref.keys[layer], ref.values[layer]))
                assert torch.equal(k, rk.to(k.dtype)) and torch.equal(v, rv.to(v.dtype)), layer
        if codec_.lossless:
            assert torch.equal(result.logits, ref.logits)
        assert result.timings.r_s > 0


def test_pipelined_messages_go_in_token_order(smollm_bf16):
    model = smollm_bf16
    L, cut = model.shape.num_layers, 3
    names = MessageNames()
    _, _, errors = _pipelined(model, _ids(800), Action("int8", cut, L), 256, hooks=names)
    assert not errors
    expected = ["plan"]
    for k, chunk_name in enumerate(["boundary", "boundary.1", "boundary.2"]):
        expected += [chunk_name, *(f"layer.{i}.{k}" for i in range(cut))]
    assert names.names == expected


def test_a_chunked_prefill_computes_below_the_cut_in_chunks(smollm_fp32, monkeypatch):
    model = smollm_fp32
    calls = []
    chunk = executor.run_layers_chunk

    def counting(model_, h, start, pos, cache, stop=None):
        calls.append((start, pos, stop, h.shape[0]))
        return chunk(model_, h, start, pos, cache, stop)

    monkeypatch.setattr("rekv_core.handoff.source.run_layers_chunk", counting)
    released = []
    source = ChunkedPrefill(model, _ids(600), 9, 256, on_done=lambda: released.append(1))
    produced = list(source.chunks())
    assert calls == [(0, 0, 9, 256), (0, 256, 9, 344)]
    assert [c.rows for c in produced] == [(0, 256), (256, 600)]
    assert [len(c.layers) for c in produced] == [9, 9]
    assert released == [1] and source.compute_s > 0
    whole = prefill(model, _ids(600), {9})
    assert torch.equal(torch.cat([c.boundary for c in produced]), whole.hidden[9])


def test_what_cannot_be_pipelined_is_refused(smollm_bf16):
    model = smollm_bf16
    L = model.shape.num_layers
    for cut in (0, L):
        with pytest.raises(ValueError, match="cut"):
            ChunkedPrefill(model, _ids(300), cut, 256)
    with pytest.raises(ValueError, match="chunk_tokens"):
        ChunkedPrefill(model, _ids(300), 5, 0)
    tokens = Delivery(streamed=True, chunk_tokens=256, order=Order.TOKENS)
    with pytest.raises(ValueError, match="pipelined"):
        Delivery(streamed=False, chunk_tokens=256, order=Order.TOKENS)
    with pytest.raises(ValueError, match="pipelined"):
        Delivery(streamed=True, chunk_tokens=0, order=Order.TOKENS)
    with pytest.raises(ValueError, match="pipelined"):
        HandoffPlan(Action("bf16", L, L), 300, model.shape, tokens)
    with pytest.raises(ValueError, match="codec: spectrum30"):
        HandoffPlan(Action("spectrum30", 5, L), 600, model.shape, tokens)
    with InProcessLink() as link:
        link.receiver.open("r")
        wider = Delivery(streamed=True, chunk_tokens=512, order=Order.TOKENS)
        with pytest.raises(ValueError, match="boundary's chunks"):
            send_handoff(link.sender, HandoffPlan(Action("bf16", 5, L), 600, model.shape, wider),
                         ChunkedPrefill(model, _ids(600), 5, 256), Transfer("r"))


def test_a_layers_rows_out_of_order_are_refused(smollm_bf16):
    model = smollm_bf16
    L = model.shape.num_layers

    def second_chunk_first(message):  # layer 0's second rows are named as its first again
        if message.name == "layer.0.1":
            message.name = "layer.0.0"
        return [message]

    with pytest.raises(TransportError, match="unexpected message 'layer.0.0'"):
        _pipelined(model, _ids(600), Action("bf16", 4, L), 256, fault=second_chunk_first)


def test_a_pipelined_handoff_is_sealed_and_encrypted_like_any_other(smollm_bf16):
    """Every chunk's messages are sealed with the handoff's key and, when asked, encrypted: the
    cache is the reference's, and a receiver with another key refuses the first message."""
    model = smollm_bf16
    L, ids, key = model.shape.num_layers, _ids(600, seed=5), new_key()
    action = Action("bf16", 12, L)
    ref = prefill(model, ids)
    result, errors = run_handoff(model, ids, action, ChunkedPrefill(model, ids, 12, 256), 256,
                                 key=key, encrypted=True)
    assert not errors and result.plan.pipelined
    assert torch.equal(result.logits, ref.logits)
    k, v = result.cache.layer(5)
    assert torch.equal(k, ref.keys[5]) and torch.equal(v, ref.values[5])
    with pytest.raises(SealError, match="plan: handoff MAC mismatch"):
        run_handoff(model, ids, action, ChunkedPrefill(model, ids, 12, 256), 256, key=key,
                    encrypted=True, receiver_key=new_key())
