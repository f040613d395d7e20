"""KVPR's token split as a handoff over the in-process link, on the embedded model in BF16.

The boundary's rows [0, l) go before the suffix layers' rows [l, S) (first from a finished
prefill, right after layer c − 1 from a live one) and the head last; the decode side's cache
equals the prefill's bit for bit where it recomputed (rows [0, l) of layers c..L−1) or where a
lossless codec carried it, and the codec's own round trip of the rows it was sent; the first
logits equal the prefill's; the bytes received equal `wire_bytes`; a split the plan cannot serve
is refused naming `split`."""

import pytest
import torch

from rekv_core.codecs import get_codec
from rekv_core.handoff import (Action, ActionKind, Delivery, HandoffPlan, Order, ReceiveMode,
                               Receiving, wire_bytes)
from rekv_core.handoff.source import LivePrefill
from rekv_core.model import prefill
from rekv_core.model.executor import final_logits
from tests.support.inprocess_handoff import MessageNames, run_handoff

SEQ_LEN, CUT, SPLIT = 600, 12, 256


@pytest.fixture(scope="module")
def reference(smollm_bf16):
    ids = torch.randint(1000, 40000, (SEQ_LEN,),
                        generator=torch.Generator().manual_seed(5)).tolist()
    return ids, prefill(smollm_bf16, ids)


def _run(model, ids, out, action, streamed, chunk_tokens=0, mode=ReceiveMode.OVERLAP):
    hooks = MessageNames()
    source = (LivePrefill(model, ids, action.cut, through=model.shape.num_layers) if streamed
              else out)
    result, errors = run_handoff(model, ids, action, source, chunk_tokens, Receiving(mode),
                                 hooks=hooks)
    assert errors == []
    return result, hooks.names


@pytest.mark.parametrize("streamed,chunk_tokens,mode", [
    (False, 0, ReceiveMode.OVERLAP), (True, 0, ReceiveMode.OVERLAP),
    (True, 256, ReceiveMode.OVERLAP), (False, 256, ReceiveMode.SEQUENTIAL)])
def test_a_lossless_split_rebuilds_the_cache_and_logits_bit_for_bit(smollm_bf16, reference,
                                                                    streamed, chunk_tokens, mode):
    model = smollm_bf16
    ids, out = reference
    L = model.shape.num_layers
    action = Action("bf16", CUT, L, split=SPLIT)
    assert action.kind is ActionKind.TOKEN_SPLIT and action.lossless
    result, names = _run(model, ids, out, action, streamed, chunk_tokens, mode)
    for layer in range(L):
        k, v = result.cache.layer(layer)
        assert torch.equal(k, out.keys[layer]) and torch.equal(v, out.values[layer]), layer
    assert torch.equal(result.logits, final_logits(model, out.hidden[L][-1]))
    assert result.bytes == wire_bytes(action, model.shape, SEQ_LEN)
    boundary = ["boundary"]  # rows [0, 256): one chunk at any chunk size
    layers = [f"layer.{i}" for i in range(L)]
    if streamed:  # the boundary right after the last prefix layer, ahead of the suffix rows
        assert names == ["plan", *layers[:CUT], *boundary, *layers[CUT:], "head"]
    else:
        assert names == ["plan", *boundary, *layers, "head"]


def test_with_int8_the_sent_rows_are_the_codecs_and_the_recomputed_rows_exact(smollm_bf16,
                                                                             reference):
    model = smollm_bf16
    ids, out = reference
    L, codec = model.shape.num_layers, get_codec("int8")
    action = Action("int8", CUT, L, split=SPLIT)
    assert not action.lossless
    result, _ = _run(model, ids, out, action, streamed=True, chunk_tokens=256)
    for layer in range(L):
        k, v = result.cache.layer(layer)
        start = 0 if layer < CUT else SPLIT
        sent_k, sent_v = codec.decode(codec.encode(out.keys[layer][:, start:].contiguous(),
                                                   out.values[layer][:, start:].contiguous()))
        assert torch.equal(k[:, start:], sent_k.to(model.dtype)), layer
        assert torch.equal(v[:, start:], sent_v.to(model.dtype)), layer
        if layer >= CUT:  # recomputed from the BF16 boundary: exact
            assert torch.equal(k[:, :SPLIT], out.keys[layer][:, :SPLIT]), layer
            assert torch.equal(v[:, :SPLIT], out.values[layer][:, :SPLIT]), layer
    assert torch.equal(result.logits, final_logits(model, out.hidden[L][-1]))
    assert result.bytes == wire_bytes(action, model.shape, SEQ_LEN)


def test_the_bytes_are_the_boundary_rows_the_suffix_rows_the_prefix_and_the_head(smollm_bf16):
    shape = smollm_bf16.shape
    L, S, d = shape.num_layers, 2048, shape.hidden_size
    joint = wire_bytes(Action("int8", CUT, L), shape, S)
    split = wire_bytes(Action("int8", CUT, L, split=512), shape, S)
    whole = wire_bytes(Action("int8", L, L), shape, S)
    row_kv = (whole.prefix + whole.scales) / L / S  # one token of one layer, int8 + scales
    assert split.boundary == 512 * d * 2 and split.head == d * 2
    assert split.prefix + split.scales == pytest.approx(
        (CUT * S + (L - CUT) * (S - 512)) * row_kv, rel=1e-3)
    assert split.state < whole.state  # h_c rows instead of 18 layers' KV of those rows
    assert joint.prefix == CUT * whole.prefix // L


def test_a_split_the_plan_cannot_serve_is_refused_naming_split(smollm_bf16):
    shape = smollm_bf16.shape
    L = shape.num_layers
    for bad in (dict(cut=L, split=256), dict(cut=0, split=256), dict(cut=CUT, split=300),
                dict(cut=CUT, split=-256)):
        with pytest.raises(ValueError, match="split"):
            Action("int8", bad["cut"], L, split=bad["split"])
    with pytest.raises(ValueError, match="split"):
        HandoffPlan(Action("int8", CUT, L, split=512), 512, shape)
    with pytest.raises(ValueError, match="pipelined"):
        HandoffPlan(Action("int8", CUT, L, split=256), 600, shape,
                    Delivery(True, 256, Order.TOKENS))
    plan = HandoffPlan(Action("int8", CUT, L, split=256), 600, shape, Delivery(True, 256))
    assert HandoffPlan.from_bytes(plan.to_bytes(), shape) == plan
    assert plan.boundary_chunks == [(0, 256)]
