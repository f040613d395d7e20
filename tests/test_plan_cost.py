"""The cost model and the estimates that feed it."""

import dataclasses

import pytest

from rekv_core.handoff import Action
from rekv_core.handoff.action import wire_bytes
from rekv_core.model.shapes import get_preset
from rekv_core.plan import CostInputs, choose, predict
from rekv_core.plan.estimates import LayerCost, LinkEstimate

SHAPE = get_preset("smollm2-135m")
L = SHAPE.num_layers


def _inputs(gbps, gamma=2.0, S=2048):
    return CostInputs(SHAPE, S, gbps, gamma, {"bf16": 0.0, "int8": 0.5},
                      {"bf16": 0.01, "int8": 0.01}, 1.0)


def test_prediction_follows_the_byte_model_and_eq9():
    inputs = _inputs(1.0)
    full = predict(Action.full_bf16(L), inputs)
    bytes_per_ms = 1e9 / 8 / 1e3
    assert full.bytes == wire_bytes(Action.full_bf16(L), SHAPE, 2048).total
    assert full.r_ms == 0 and full.total_ms == pytest.approx(full.x_ms + full.h_ms + 1.0)
    assert full.x_ms >= full.bytes / bytes_per_ms
    token = predict(Action.token_only(L), inputs)
    assert token.r_ms == L * 2.0 and token.x_ms == 0
    joint = predict(Action("int8", 20, L), inputs)
    assert joint.r_ms == 10 * 2.0
    assert joint.total_ms == pytest.approx(joint.h_ms + max(joint.x_ms, joint.r_ms) + 1.0)


def test_choice_moves_with_the_link():
    fast = choose(_inputs(400.0), ["bf16", "int8"])[0].action
    assert fast.kind.value in ("bf16_transfer", "quant_transfer")
    slow = choose(_inputs(0.05), ["bf16", "int8"])[0].action
    assert slow.kind.value == "token_recompute"  # cheap compute, a slow link
    # all BF16 KV (47 MiB) takes about as long on the link as all layers take to compute
    middle = choose(_inputs(0.4, gamma=30.0), ["bf16", "int8"])
    assert middle[0].action.kind.value == "joint"
    assert [p.total_ms for p in middle] == sorted(p.total_ms for p in middle)


def test_link_estimate_moves_with_observed_transfers():
    link = LinkEstimate(10.0, min_bytes=1000)
    assert link.gbps == 10.0
    link.observe(500, 1.0)  # too small to say anything about the rate
    assert link.gbps == 10.0
    link.observe(125_000_000, 1.0)  # 1 Gb/s
    assert link.gbps == pytest.approx(1.0)
    for _ in range(10):
        link.observe(250_000_000, 1.0)
    assert link.gbps == pytest.approx(2.0)
    link.observe(250_000_000, 0.1)  # one disturbed sample (20 Gb/s) does not move it
    assert link.gbps == pytest.approx(2.0)
    for _ in range(4):  # a real change does, within half the window
        link.observe(125_000_000, 1.0)
    assert link.gbps == pytest.approx(1.5)
    link.observe(125_000_000, 1.0)
    assert link.gbps == pytest.approx(1.0)


def test_layer_cost_interpolates_and_grows_beyond_the_profile():
    cost = LayerCost([64, 256, 1024], [1.0, 2.0, 12.0])
    assert cost.at(10) == 1.0 and cost.at(160) == pytest.approx(1.5)
    assert cost.at(2048) > 2 * cost.at(1024)  # the last segment grew faster than linearly
    with pytest.raises(ValueError):
        LayerCost([], [])


def test_per_message_cost_favours_fewer_messages():
    base = _inputs(10.0, gamma=2.0, S=256)
    costly = CostInputs(SHAPE, 256, 10.0, 2.0, {"bf16": 0.0, "int8": 0.5},
                        {"bf16": 0.01, "int8": 0.01}, 1.0, message_ms=3.0)
    joint = Action("int8", 20, L)
    assert predict(joint, costly).x_ms == pytest.approx(predict(joint, base).x_ms + 20 * 3.0)
    assert predict(joint, costly).h_ms == pytest.approx(predict(joint, base).h_ms + 3.0)
    # with a 3 ms cost per message, recomputing 30 cheap layers beats sending 30 messages
    assert choose(costly, ["bf16", "int8"])[0].action.cut < choose(base, ["bf16", "int8"])[
        0].action.cut


def test_restore_is_charged_per_codec():
    """Each codec's prefix pays its own restore cost, not the slowest codec's."""
    cheap_int4 = CostInputs(SHAPE, 2048, 1.0, 2.0, {"int8": 0.5, "int4": 0.5},
                            {"int8": 2.0, "int4": 0.1}, 1.0)
    layer_mib = SHAPE.kv_layer_bytes(2048) / 2**20
    free = dataclasses.replace(cheap_int4, restore_ms_per_mib={})
    for codec, per_mib in (("int8", 2.0), ("int4", 0.1)):
        action = Action(codec, 12, L)
        extra = predict(action, cheap_int4).x_ms - predict(action, free).x_ms
        assert extra == pytest.approx(per_mib * layer_mib * 12)
