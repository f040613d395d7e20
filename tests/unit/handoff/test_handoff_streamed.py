"""Streamed handoffs, partial prefill and the chunked boundary.

A suffix run one boundary chunk at a time is bit-identical to the unchunked run; a handoff sent
from inside the prefill (`LivePrefill`) computes only the layers below the cut and rebuilds the
same cache and first-token logits as a finished prefill's handoff, for every kind of action and
chunk size; the prefill's compute lock is released exactly once, even when the send fails; the
receiver refuses messages out of their kind's order."""

import threading

import pytest
import torch

from rekv_core.codecs import get_codec
from rekv_core.handoff import (Action, Delivery, ReceiveMode, Receiving, receive_handoff,
                               send_handoff, wire_bytes)
from rekv_core.handoff.source import LivePrefill
from rekv_core.handoff.transfer import Transfer, TransferCancelled
from rekv_core.model import KVCache, executor, prefill, run_layers, run_layers_chunk
from rekv_core.model.blocks import EXEC_BLOCK, chunk_bounds
from rekv_core.model.executor import final_logits
from rekv_core.transport import TransportError
from rekv_core.transport.inprocess import InProcessLink
from tests.support.inprocess_handoff import MessageNames, planned, run_handoff


def test_chunk_bounds():
    assert chunk_bounds(700, 0) == [(0, 700)]
    assert chunk_bounds(700, 256) == [(0, 256), (256, 700)]  # a tail under a block joins
    assert chunk_bounds(1100, 256) == [(0, 256), (256, 512), (512, 768), (768, 1100)]
    assert chunk_bounds(768, 256) == [(0, 256), (256, 512), (512, 768)]
    assert chunk_bounds(100, 512) == [(0, 100)]
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunk_bounds(700, 100)
    with pytest.raises(ValueError, match="chunk_tokens"):
        Delivery(chunk_tokens=300)


def _ids(n, seed=0):
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("seq_len", [700, 1100])
def test_chunked_suffix_is_bit_identical(smollm_fp32, smollm_bf16, dtype, seq_len):
    model = smollm_fp32 if dtype == "fp32" else smollm_bf16
    cut, L = 12, model.shape.num_layers
    state = prefill(model, _ids(seq_len), boundaries={cut})
    ref = run_layers(model, state.hidden[cut], cut)
    for chunk in (EXEC_BLOCK, 2 * EXEC_BLOCK, 3 * EXEC_BLOCK):
        cache = KVCache(L, model.shape.num_kv_heads, model.shape.head_dim, seq_len + 3,
                        model.dtype)
        for s0, s1 in chunk_bounds(seq_len, chunk):
            h = run_layers_chunk(model, state.hidden[cut][s0:s1], cut, s0, cache)
        assert torch.equal(final_logits(model, h[-1]), ref.logits), chunk
        for j in range(L - cut):
            assert torch.equal(cache.keys[cut + j][:, :seq_len], ref.keys[j]), (chunk, j)
            assert torch.equal(cache.values[cut + j][:, :seq_len], ref.values[j]), (chunk, j)
            # and the same as the prefill's own layers: the suffix is what the prefill computed
            assert torch.equal(ref.keys[j], state.keys[cut + j])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_prefill_in_token_chunks_up_to_the_cut_is_bit_identical(smollm_fp32, smollm_bf16,
                                                                  dtype):
    """The building block of a pipelined handoff: the prefill side runs layers [0, c) chunk by
    chunk, so each chunk's h_c rows can leave while the next chunk computes."""
    model = smollm_fp32 if dtype == "fp32" else smollm_bf16
    cut, L, seq_len = 12, model.shape.num_layers, 700
    ids = _ids(seq_len, seed=3)
    state = prefill(model, ids, boundaries={cut})
    for chunk in (EXEC_BLOCK, 2 * EXEC_BLOCK):
        cache = KVCache(L, model.shape.num_kv_heads, model.shape.head_dim, seq_len, model.dtype)
        rows = [run_layers_chunk(model, executor.embed(model, ids[s0:s1]), 0, s0, cache, stop=cut)
                for s0, s1 in chunk_bounds(seq_len, chunk)]
        assert torch.equal(torch.cat(rows), state.hidden[cut]), chunk
        for layer in range(cut):
            assert torch.equal(cache.keys[layer][:, :seq_len], state.keys[layer]), (chunk, layer)
            assert torch.equal(cache.values[layer][:, :seq_len], state.values[layer])
    with pytest.raises(ValueError, match="outside"):
        run_layers_chunk(model, executor.embed(model, ids[:8]), 0, 0, cache, stop=L + 1)


def _streamed(model, ids, action, chunk_tokens=0, mode=ReceiveMode.OVERLAP, on_done=None,
              transfer=None, hooks=None):
    source = LivePrefill(model, ids, action.cut, on_done=on_done)
    result, errors = run_handoff(model, ids, action, source, chunk_tokens, Receiving(mode),
                                 transfer, hooks)
    return source, result, errors


@pytest.mark.parametrize("codec,cut,chunk", [
    ("bf16", 30, 0), ("bf16", 11, 0), ("bf16", 11, 256), ("bf16", 1, 512), ("bf16", 0, 0),
    ("int8", 11, 256), ("int8", 30, 0), ("int4", 29, 256)])
def test_streamed_handoff_rebuilds_the_cache(smollm_bf16, codec, cut, chunk):
    model = smollm_bf16  # BF16 on the wire is exact for a BF16 model
    L = model.shape.num_layers
    ids = _ids(520, seed=cut)  # two boundary chunks of 256
    action = Action(codec, cut, L)
    ref = prefill(model, ids)
    for mode in list(ReceiveMode) if codec == "int8" and chunk else [ReceiveMode.OVERLAP]:
        source, result, errors = _streamed(model, ids, action, chunk, mode)
        assert not errors
        assert result.bytes == wire_bytes(action, model.shape, len(ids))
        codec_ = get_codec(codec)
        for layer in range(L):
            k, v = result.cache.layer(layer)
            if layer >= cut or codec_.lossless:
                assert torch.equal(k, ref.keys[layer]) and torch.equal(v, ref.values[layer])
            else:  # exactly what the codec makes of the prefill's layer
                rk, rv = codec_.decode(codec_.encode(ref.keys[layer], ref.values[layer]))
                assert torch.equal(k, rk.to(k.dtype)) and torch.equal(v, rv.to(v.dtype))
        if cut == L or codec_.lossless or cut == 0:
            assert torch.equal(result.logits, ref.logits)
        if 0 < cut < L:
            assert result.timings.r_s > 0


@pytest.mark.parametrize("codec,cut", [("bf16", 9), ("bf16", 1), ("int8", 9)])
def test_a_streamed_boundary_follows_the_whole_prefix(smollm_bf16, codec, cut):
    """Streamed: the layers as they are computed, then the boundary's chunks (layer c−1 starts
    the decode side's link sample, the first chunk completes it); the cache is the reference's."""
    model = smollm_bf16
    L = model.shape.num_layers
    ids = _ids(520, seed=cut)  # two boundary chunks of 256
    names = MessageNames()
    _, result, errors = _streamed(model, ids, Action(codec, cut, L), 256, hooks=names)
    assert not errors
    assert names.names == ["plan", *(f"layer.{i}" for i in range(cut)), "boundary",
                           "boundary.1"]
    ref = prefill(model, ids)
    for layer in range(cut, L):
        k, v = result.cache.layer(layer)
        assert torch.equal(k, ref.keys[layer]) and torch.equal(v, ref.values[layer])
    if codec == "bf16":
        k, v = result.cache.layer(cut - 1)
        assert torch.equal(k, ref.keys[cut - 1]) and torch.equal(v, ref.values[cut - 1])
        assert torch.equal(result.logits, ref.logits)


def test_partial_prefill_computes_only_the_layers_below_the_cut(smollm_fp32, monkeypatch):
    model = smollm_fp32
    L = model.shape.num_layers
    computed = []
    layer = executor.layer_forward

    def counting(model_, index, *args, **kwargs):
        if threading.current_thread().name == "rekv-test-sender":
            computed.append(index)
        return layer(model_, index, *args, **kwargs)

    monkeypatch.setattr(executor, "layer_forward", counting)
    for cut in (0, 7, L):
        computed.clear()
        released = []
        source = LivePrefill(model, _ids(300), cut, on_done=lambda: released.append(1))
        thread = threading.Thread(target=lambda: list(source.layers()), name="rekv-test-sender")
        thread.start()
        thread.join()
        assert computed == list(range(cut)), cut
        assert released == [1]
        if 0 < cut:
            assert torch.equal(source.boundary(), prefill(model, _ids(300), {cut}).hidden[cut])


def test_the_compute_is_released_once_when_the_send_fails(smollm_fp32):
    model = smollm_fp32
    L = model.shape.num_layers
    released = []
    transfer = Transfer("r", stall_s=5)
    transfer.cancel()
    with pytest.raises(TransferCancelled):
        with InProcessLink() as link:
            link.receiver.open("r")
            source = LivePrefill(model, _ids(200), 10, on_done=lambda: released.append(1))
            try:
                send_handoff(link.sender, *planned(model, _ids(200), Action("int8", 10, L),
                                                   source), transfer)
            finally:
                source.close()
                source.close()
    assert released == [1]


def test_messages_out_of_their_kinds_order_are_refused(smollm_fp32):
    model = smollm_fp32
    L = model.shape.num_layers
    ids = _ids(300)
    state = prefill(model, ids)

    def swap_layers(message):  # layer.1 goes out as layer.0's successor twice
        if message.name == "layer.2":
            message.name = "layer.1"
        return [message]

    with InProcessLink(fault=swap_layers) as link:
        link.receiver.open("r")
        plan, source = planned(model, ids, Action("bf16", 5, L), state, chunk_tokens=256)
        sender = threading.Thread(target=lambda: send_handoff(link.sender, plan, source,
                                                              Transfer("r")))
        sender.start()
        with pytest.raises(TransportError, match="unexpected message 'layer.1'"):
            receive_handoff(model, link.receiver, Transfer("r", stall_s=10))
        sender.join()
