"""KVPR's per-layer form as a handoff over the in-process link (`Action.layer_split` l).

Each sent layer's input rows [0, l) go right before the layer, whose message carries its rows
[l, S); the decode side recomputes K and V of [0, l) from them. On the MHA preset and the
embedded GQA model, in BF16: the cache equals the prefill's bit for bit with a lossless codec, and
with `int8` the recomputed rows equal the prefill's while the sent rows equal the codec's own
round trip of those rows; the first logits are the prefill's; the bytes received equal
`wire_bytes`, which is the formula; the action and the plan refuse what the form cannot serve,
naming `layer_split`; a ruined input message costs its layer, which a salvage names."""

import pytest
import torch

from rekv_core.codecs import get_codec
from rekv_core.handoff import (Action, ActionKind, Delivery, HandoffPlan, Order, Receiving,
                               wire_bytes)
from rekv_core.handoff.recovery import PartialHandoff
from rekv_core.handoff.source import LivePrefill
from rekv_core.model import Model, prefill
from rekv_core.model.executor import final_logits
from rekv_core.model.shapes import get_preset
from rekv_core.model.weights import synthetic_weights
from rekv_core.transport import Message
from tests.support.inprocess_handoff import MessageNames, run_handoff

SEQ_LEN, SPLIT = 300, 256


@pytest.fixture(scope="module")
def mha_bf16():
    return Model(synthetic_weights(get_preset("mini-llama-2-7b"), torch.bfloat16, seed=3))


@pytest.fixture(scope="module")
def models(mha_bf16, smollm_bf16):
    ids = torch.randint(100, 30000, (SEQ_LEN,), generator=torch.Generator().manual_seed(7)
                        ).tolist()
    return {name: (model, ids, prefill(model, ids))
            for name, model in (("mha", mha_bf16), ("smollm", smollm_bf16))}


def _run(model, ids, out, action, streamed, **kwargs):
    hooks = MessageNames()
    source = (LivePrefill(model, ids, action.cut, through=action.sent_layers,
                          input_rows=action.layer_split) if streamed else out)
    result, errors = run_handoff(model, ids, action, source, hooks=hooks, **kwargs)
    return result, errors, hooks.names


@pytest.mark.parametrize("which", ["mha", "smollm"])
@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("transfer_only", [False, True])
def test_a_lossless_layer_split_rebuilds_the_cache_bit_for_bit(models, which, streamed,
                                                                 transfer_only):
    model, ids, out = models[which]
    L = model.shape.num_layers
    cut = L if transfer_only else 9
    action = Action("bf16", cut, L, layer_split=SPLIT)
    assert action.kind is (ActionKind.BF16_TRANSFER if transfer_only
                           else ActionKind.BF16_RECOMPUTE) and action.lossless
    result, errors, names = _run(model, ids, out, action, streamed)
    assert errors == []
    for layer in range(L):
        k, v = result.cache.layer(layer)
        assert torch.equal(k, out.keys[layer]) and torch.equal(v, out.values[layer]), layer
    assert torch.equal(result.logits, out.logits)
    assert result.bytes == wire_bytes(action, model.shape, SEQ_LEN)
    sent = [name for i in range(cut) for name in (f"inputs.{i}", f"layer.{i}")]
    if transfer_only:
        assert names == ["plan", *sent, "head"]
    elif streamed:  # the boundary once the prefill has reached the cut
        assert names == ["plan", *sent, "boundary"]
    else:
        assert names == ["plan", "boundary", *sent]


def test_int8_rows_are_the_codecs_round_trip_and_recomputed_rows_exact(models):
    model, ids, out = models["mha"]
    L, cut = model.shape.num_layers, 6
    action = Action("int8", cut, L, layer_split=SPLIT)
    assert action.kind is ActionKind.JOINT and not action.lossless
    result, errors, _ = _run(model, ids, out, action, streamed=True)
    assert errors == []
    codec = get_codec("int8")
    for layer in range(cut):
        k, v = result.cache.layer(layer)
        assert torch.equal(k[:, :SPLIT], out.keys[layer][:, :SPLIT])
        assert torch.equal(v[:, :SPLIT], out.values[layer][:, :SPLIT])
        rk, rv = codec.decode(codec.encode(out.keys[layer][:, SPLIT:].contiguous(),
                                           out.values[layer][:, SPLIT:].contiguous()))
        assert torch.equal(k[:, SPLIT:], rk.to(k.dtype)) and torch.equal(v[:, SPLIT:],
                                                                          rv.to(v.dtype))
    for layer in range(cut, L):  # recomputed from the exact boundary
        k, v = result.cache.layer(layer)
        assert k.shape[1] == SEQ_LEN


def test_the_bytes_are_the_formula():
    shape = get_preset("llama-2-7b")
    S, l, L, c = 4096, 1024, shape.num_layers, 20
    d, kv_row = shape.hidden_size, 2 * shape.num_kv_heads * shape.head_dim
    joint = wire_bytes(Action("bf16", c, L, layer_split=l), shape, S)
    assert joint.prefix == c * (l * d * 2 + (S - l) * kv_row * 2)
    assert joint.boundary == S * d * 2 and joint.scales == 0
    whole = wire_bytes(Action("bf16", L, L), shape, S)
    every = wire_bytes(Action("bf16", L, L, layer_split=S - 256), shape, S)
    assert every.prefix == L * ((S - 256) * d * 2 + 256 * kv_row * 2)
    assert every.prefix < 0.54 * whole.prefix  # MHA: an input row is half its K and V row
    gqa = get_preset("qwen2.5-7b")  # GQA 7:1: an input row is 3.5 times its K and V row
    assert (wire_bytes(Action("bf16", 28, 28, layer_split=1024), gqa, S).prefix
            > wire_bytes(Action("bf16", 28, 28), gqa, S).prefix)


@pytest.mark.parametrize("kwargs,field", [
    ({"layer_split": 100}, "layer_split"), ({"layer_split": -256}, "layer_split"),
    ({"layer_split": 256, "cut": 0}, "layer_split"),
    ({"layer_split": 256, "split": 256}, "layer_split"),
    ({"layer_split": 256, "codec": "int8", "progressive": True}, "layer_split")])
def test_the_action_refuses_what_the_form_cannot_serve(kwargs, field):
    args = {"codec": "bf16", "cut": 10, "num_layers": 32, **kwargs}
    with pytest.raises(ValueError, match=field):
        Action(args.pop("codec"), args.pop("cut"), args.pop("num_layers"), **args)


def test_the_plan_carries_the_form_and_refuses_token_order():
    shape = get_preset("mini-llama-2-7b")
    action = Action("int8", 12, shape.num_layers, layer_split=512)
    plan = HandoffPlan(action, 1000, shape, Delivery(True, 256))
    assert HandoffPlan.from_bytes(plan.to_bytes(), shape).action == action
    with pytest.raises(ValueError, match="layer_split"):
        HandoffPlan(action, 512, shape)
    with pytest.raises(ValueError, match="pipelined"):
        HandoffPlan(action, 1000, shape, Delivery(True, 256, Order.TOKENS))


class _RuinInputs:
    """Send hooks that flip a byte of one layer's input rows after sealing."""

    def __init__(self, name):
        self.name = name

    def before_send(self, message):
        if message.name != self.name:
            return message
        h = message.buffers["h"].clone()
        h[0] ^= 0xFF
        return Message(message.request_id, message.seq, message.name, message.header,
                       {"h": h})

    def after_send(self, name):
        pass


def test_ruined_input_rows_cost_their_layer_and_nothing_else(models):
    model, ids, out = models["mha"]
    L, cut = model.shape.num_layers, 5
    action = Action("bf16", cut, L, layer_split=SPLIT)
    with pytest.raises(PartialHandoff) as caught:
        run_handoff(model, ids, action, out, receiving=Receiving(keep_verified=True),
                    hooks=_RuinInputs("inputs.2"))
    salvage = caught.value.salvage
    assert 2 not in salvage.verified and {0, 1, 3, 4} <= set(salvage.verified)
