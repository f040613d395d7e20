"""KVPR's token splits among the planner's actions: each (codec, interior cut) is ranked with the
closed form's l, only when both workers take splits; the prediction's bytes are the wire's; where
recomputing the first rows hides behind the rest of the wire the split beats sending those rows,
and where the recompute is dear no split is offered; the quality gate's policy admits a lossy
split only where the codec passed at every layer, and the lossless setting only lossless ones."""

import dataclasses

import pytest

from rekv_core.handoff import Action, ActionKind, wire_bytes
from rekv_core.model.shapes import get_preset
from rekv_core.plan.cost import CostInputs, choose, predict, split_actions, split_costs
from rekv_core.plan.planner import Planner
from rekv_core.plan.policy import Policy
from rekv_core.plan.quality import Quality
from rekv_core.plan.token_split import best_split, brute_force_split

SHAPE = get_preset("smollm2-135m")
L = SHAPE.num_layers


def _inputs(gbps=1.0, gamma=4.0, S=2048, streamed=False, splits=True):
    return CostInputs(SHAPE, S, gbps, gamma, prefill_ms_per_layer=1.0, streamed=streamed,
                      chunk_tokens=256 if streamed else 0, message_ms=0.1, token_splits=splits)


def test_splits_are_ranked_only_when_both_workers_take_them():
    assert not any(p.action.split for p in choose(_inputs(splits=False), ["int8"]))
    ranked = [p.action for p in choose(_inputs(), ["int8"]) if p.action.split]
    assert ranked and all(a.kind is ActionKind.TOKEN_SPLIT and 0 < a.cut < L for a in ranked)


@pytest.mark.parametrize("streamed", [False, True])
def test_each_split_is_the_closed_forms_and_its_bytes_the_wires(streamed):
    inputs = _inputs(streamed=streamed)
    for action in split_actions(inputs, ["bf16", "int8", "int4"]):
        costs = split_costs(inputs, action.codec, action.cut)
        assert action.split == best_split(costs, 2048) == brute_force_split(costs, 2048)
        p = predict(action, inputs)
        assert p.bytes == wire_bytes(action, SHAPE, 2048).total
        assert p.r_ms == pytest.approx((L - action.cut) * 4.0 * action.split / 2048)


@pytest.mark.parametrize("streamed", [False, True])
def test_a_recompute_hidden_behind_the_wire_beats_sending_those_rows(streamed):
    """At 1 Gb/s with γ = 20 ms a layer the recompute of the first rows fits behind the rest of
    the wire: every split predicts less than sending every layer whole (within the message more
    it sends, where few suffix layers make a boundary row cost what its KV does); most predict
    clearly less. A free recompute offers
    no split (recomputing every row, the joint action, is better) and a dear one neither."""
    inputs = _inputs(gamma=20.0, streamed=streamed)
    whole = predict(Action("int8", L, L), inputs).total_ms
    splits = split_actions(inputs, ["int8"])
    times = [predict(a, inputs).total_ms for a in splits]
    assert splits and all(t < whole + 2 * inputs.message_ms for t in times)
    assert sum(t < 0.95 * whole for t in times) > len(times) / 2
    assert split_actions(_inputs(gamma=0.0, streamed=streamed), ["int8"]) == []
    assert split_actions(_inputs(gamma=1e5, streamed=streamed), ["int8"]) == []


def test_the_policy_admits_a_lossy_split_where_the_codec_passed_at_every_layer():
    split = Action("int8", 10, L, split=512)
    at_every_layer = Policy("smollm2-135m", (1, 8192), {"int8": L})
    below = Policy("smollm2-135m", (1, 8192), {"int8": L - 1})
    assert at_every_layer.eligible(split) and not below.eligible(split)
    assert below.eligible(Action("int8", 10, L))  # the joint action at that cut still is
    assert Action("bf16", 10, L, split=512).lossless
    assert below.eligible(Action("bf16", 10, L, split=512))
    planner = Planner(below)
    decision = planner.decide(_inputs(gamma=20.0), ["bf16", "int8"], quality=Quality.GATED)
    assert all(r.prediction.action.codec == "bf16" or not r.prediction.action.split
               for r in decision.candidates)
    lossless = Planner(at_every_layer).decide(_inputs(gamma=20.0), ["bf16", "int8"],
                                              quality=Quality.LOSSLESS)
    assert all(r.prediction.action.lossless for r in lossless.candidates)
    assert any(r.prediction.action.split for r in lossless.candidates)


def test_the_planners_plan_carries_the_split():
    inputs = _inputs(gamma=20.0)
    decision = Planner(Policy("smollm2-135m", (1, 8192), {"int8": L})).decide(
        inputs, ["int8"], quality=Quality.GATED)
    assert decision.action.split and decision.plan.boundary_rows == decision.action.split
    assert decision.as_dict()["chosen"]["split"] == decision.action.split
    # the measured medians of a split correct only splits: a joint action is no neighbour
    assert dataclasses.replace(decision.action, split=0).kind is ActionKind.JOINT
