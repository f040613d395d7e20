"""KVPR's per-layer form in the planner: the closed form's l equals a brute-force search of the
same time model on random points; the form is ranked only where an input row is lighter than a
K and V row (the MHA presets, ReKV's Proposition 1), where the planner takes it on a slow link and
a cheap recompute, and not where the recompute is dear; its prediction charges the recompute; the
gate's verdict is the codec's action's."""

import random

import pytest

from rekv_core.handoff import Action
from rekv_core.model.shapes import PRESETS, get_preset
from rekv_core.plan.cost import CostInputs, choose, predict
from rekv_core.plan.evidence import CodecCost
from rekv_core.plan.layer_split import (LayerSplitCosts, best_layer_split,
                                        brute_force_layer_split, layer_split_actions,
                                        layer_split_costs, layer_split_time, projection_share)
from rekv_core.plan.policy import Policy


def test_the_closed_form_equals_the_brute_force_on_random_points():
    rng = random.Random(11)
    for _ in range(2000):
        b = rng.uniform(1e-4, 1e-2)
        costs = LayerSplitCosts(input_row_ms=b * rng.uniform(0.2, 1.5), kv_row_ms=b,
                                recompute_row_ms=rng.choice([0.0, rng.uniform(0, 3e-2)]),
                                restore_row_ms=rng.choice([0.0, rng.uniform(0, 1e-2)]),
                                step_ms=rng.choice([0.0, rng.uniform(0, 50)]),
                                message_ms=rng.uniform(0, 2), layers=rng.randint(1, 40))
        S = rng.randint(1, 9000)
        assert best_layer_split(costs, S) == brute_force_layer_split(costs, S), (costs, S)


def test_one_layer_is_the_seeds_crossing():
    """One layer, nothing else to overlap: T = a·l + b·(S − l) + g·l, least at l = 0 unless the
    recompute costs less per row than the link saves (a + g < b): then the largest l."""
    costs = LayerSplitCosts(input_row_ms=1.0, kv_row_ms=2.0, recompute_row_ms=0.5)
    assert best_layer_split(costs, 4096) == 4096 - 256
    costs = LayerSplitCosts(input_row_ms=1.0, kv_row_ms=2.0, recompute_row_ms=1.5)
    assert best_layer_split(costs, 4096) == 0
    assert layer_split_time(costs, 4096, 0) == 2.0 * 4096


def _inputs(name, link_gbps=10.0, suffix_ms_per_layer=1.0, streamed=True, **kwargs):
    return CostInputs(get_preset(name), 4096, link_gbps, suffix_ms_per_layer,
                      codec_costs={"int8": CodecCost(0.05, 0.05)}, message_ms=0.05,
                      prefill_ms_per_layer=2.0, streamed=streamed, chunk_tokens=512,
                      layer_splits=True, **kwargs)


@pytest.mark.parametrize("name", list(PRESETS))
def test_the_form_is_ranked_only_where_n_h_is_below_twice_n_kv(name):
    inputs = _inputs(name)
    L = inputs.shape.num_layers
    base = [Action("bf16", c, L) for c in range(1, L + 1)]
    ranked = layer_split_actions(inputs, ["bf16"], base)
    shape = inputs.shape
    assert bool(ranked) == (shape.num_heads < 2 * shape.num_kv_heads)
    for action in ranked:  # each at its cut's brute-force l
        costs = layer_split_costs(inputs, "bf16", action.cut)
        assert action.layer_split == brute_force_layer_split(costs, 4096) > 0


def test_the_planner_takes_it_on_a_slow_link_and_not_where_the_recompute_is_dear():
    cheap = choose(_inputs("llama-2-7b", link_gbps=5.0, suffix_ms_per_layer=150.0), ["bf16"])
    assert cheap[0].action.layer_split > 0
    plain = Action(cheap[0].action.codec, cheap[0].action.cut, 32, cheap[0].action.boundary)
    inputs = _inputs("llama-2-7b", link_gbps=5.0, suffix_ms_per_layer=150.0)
    assert cheap[0].total_ms < predict(plain, inputs).total_ms
    dear = choose(_inputs("llama-2-7b", link_gbps=400.0, suffix_ms_per_layer=500.0), ["bf16"])
    assert all(not p.action.layer_split for p in dear[:1])


def test_the_prediction_charges_the_recompute():
    inputs = _inputs("llama-2-7b", link_gbps=5.0)
    action = Action("bf16", 32, 32, layer_split=2048)
    slow = _inputs("llama-2-7b", link_gbps=5.0, suffix_ms_per_layer=400.0)
    assert predict(action, slow).total_ms > predict(action, inputs).total_ms
    share = projection_share(get_preset("llama-2-7b"), 4096)
    assert 0.1 < share < 0.3  # the fused Q, K and V projection: 3 of the layer's ~13 d² matmuls


def test_gqa_presets_rank_no_layer_split_in_choose():
    for name in ("smollm2-135m", "qwen2.5-7b", "mini-qwen3-8b"):
        assert not any(p.action.layer_split for p in choose(_inputs(name, link_gbps=1.0),
                                                            ["bf16", "int8"]))


def test_the_gate_treats_the_form_as_its_codecs_action():
    """The recomputed rows are exact and the rest is the codec's: the same verdict as (b, c)."""
    policy = Policy("mini-llama-2-7b", (1, 8192), {"int8": 13})
    assert policy.eligible(Action("int8", 13, 32, layer_split=256))
    assert not policy.eligible(Action("int8", 14, 32, layer_split=256))
    assert Action("bf16", 32, 32, layer_split=256).lossless
