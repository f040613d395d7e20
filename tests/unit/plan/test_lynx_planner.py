"""Lynx's streams among the planner's actions: every `int8` action (c >= 1, no split) is ranked also
as Lynx's streams, only when both workers take them; its bytes are `int8`'s, but only the bytes
before the residuals count towards the first token, so on a link that binds it predicts less than
the same `int8` action, by up to the residuals' wire time (all of it for transfer-only, none
where the suffix's recompute binds), and as much where the link is free; the quality
gate's policy admits it exactly where it admits that `int8` action, and the lossless setting never;
the planner picks it over `int8` where `int8` would have been its choice."""

import dataclasses

import pytest

from rekv_core.handoff import Action, wire_bytes
from rekv_core.model.shapes import get_preset
from rekv_core.plan.cost import CostInputs, choose, predict
from rekv_core.plan.planner import Planner
from rekv_core.plan.policy import Policy
from rekv_core.plan.quality import Quality

SHAPE = get_preset("smollm2-135m")
L, S = SHAPE.num_layers, 2048


def _inputs(gbps=1.0, streamed=True, progressive=True, gamma=4.0):
    return CostInputs(SHAPE, S, gbps, gamma, prefill_ms_per_layer=1.0, streamed=streamed,
                      chunk_tokens=256 if streamed else 0, message_ms=0.1,
                      progressive=progressive)


def test_lynx_is_ranked_for_int8_actions_only_when_both_workers_take_it():
    assert not any(p.action.progressive for p in choose(_inputs(progressive=False),
                                                        ["int8", "int4"]))
    lynx = [p.action for p in choose(_inputs(), ["bf16", "int8", "int4"]) if p.action.progressive]
    assert sorted(a.cut for a in lynx) == list(range(1, L + 1))
    assert all(a.codec == "int8" and not a.split for a in lynx)


@pytest.mark.parametrize("streamed", [False, True])
def test_on_a_binding_link_it_saves_the_residuals_wire_time(streamed):
    inputs = _inputs(gbps=0.5, streamed=streamed)
    per_ms = 0.5e9 / 8 / 1e3
    for cut in (6, 15, L):
        int8 = predict(Action("int8", cut, L), inputs)
        lynx = predict(Action("int8", cut, L, progressive=True), inputs)
        assert lynx.bytes == int8.bytes == wire_bytes(Action("int8", cut, L), SHAPE, S).total
        residuals = wire_bytes(Action("int8", cut, L), SHAPE, S).prefix / 2
        # never more; less by at most the residuals' wire time (none where the suffix binds)
        assert 0 <= int8.total_ms - lynx.total_ms <= residuals / per_ms + 1e-6
        if cut == L:  # nothing to recompute: the saving is the residuals' whole wire time
            assert int8.total_ms - lynx.total_ms == pytest.approx(residuals / per_ms, rel=0.05)


def test_on_a_free_link_it_predicts_what_int8_does():
    inputs = _inputs(gbps=1e6)
    for cut in (6, L):
        int8 = predict(Action("int8", cut, L), inputs).total_ms
        lynx = predict(Action("int8", cut, L, progressive=True), inputs).total_ms
        assert lynx == pytest.approx(int8, rel=1e-3)


def test_the_gate_admits_it_where_it_admits_int8_and_the_planner_prefers_it():
    policy = Policy("smollm2-135m", (1, 8192), {"int8": 12})
    planner = Planner(policy)
    for cut in (1, 12, 13, L):
        for progressive in (False, True):
            action = Action("int8", cut, L, progressive=progressive)
            assert planner.allowed(action, S) == (cut <= 12)
            assert not planner.allowed(action, S, Quality.LOSSLESS)
    # a dear decode-side recompute (60 ms a layer): a transfer wins, and Lynx's beats int8's
    planner = Planner(Policy("smollm2-135m", (1, 8192), {"int8": L}))
    decision = planner.decide(_inputs(gbps=0.5, gamma=60.0), ["int8"])
    assert decision.action.progressive, decision.action
    without = planner.decide(_inputs(gbps=0.5, gamma=60.0, progressive=False), ["int8"])
    assert dataclasses.replace(decision.action, progressive=False) == without.action
    assert decision.plan.predicted_ms < without.plan.predicted_ms
