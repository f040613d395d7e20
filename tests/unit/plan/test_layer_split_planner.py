"""KVPR's per-layer form in the planner: the closed form's l equals a brute-force search of the
same time model on random points; the form is ranked only where an input row is lighter than a
K and V row (the MHA presets, ReKV's Proposition 1), where the planner takes it on a slow link and
a cheap recompute, and not where the recompute is dear; its prediction charges the recompute; the
gate's verdict is the codec's action's."""

import random

import pytest

from rekv_core.codecs import get_codec
from rekv_core.handoff import Action
from rekv_core.handoff.action import PROGRESSIVE_CODEC
from rekv_core.model.shapes import PRESETS, get_preset
from rekv_core.plan.cost import CostInputs, choose, predict
from rekv_core.plan.evidence import CodecCost
from rekv_core.plan.layer_split import (LayerSplitCosts, allowed_layer_splits, best_layer_split,
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


def test_the_costs_are_read_off_the_inputs():
    """a, b: a row's bytes over the link's bytes per ms; g: γ's projection share over S; q and
    α: per MiB of the layer's BF16 K and V; s: the streamed layer's compute and its encoding,
    the encoding alone after a whole prefill; each codec at its own measured cost."""
    shape, S = get_preset("llama-2-7b"), 4096
    costs = {"int8": CodecCost(0.5, 0.25), "bf16": CodecCost(0.125, 0.0625)}

    def split_costs(streamed):
        inputs = CostInputs(shape, S, 8.0, 3.0, codec_costs=costs, message_ms=0.05,
                            prefill_ms_per_layer=2.0, streamed=streamed, chunk_tokens=512,
                            layer_splits=True)
        return layer_split_costs(inputs, "int8", 7)

    bytes_per_ms = 1e6  # 8 Gb/s
    kv_mib = 2 * 32 * S * 128 * 2 / 2**20  # one layer's K and V in BF16: 64 MiB
    coded = get_codec("int8").layer_bytes((32, S, 128))
    streamed = split_costs(True)
    assert streamed.input_row_ms == pytest.approx(4096 * 2 / bytes_per_ms, rel=1e-12)
    assert streamed.kv_row_ms == pytest.approx((coded.data + coded.scales) / S / bytes_per_ms)
    assert streamed.recompute_row_ms == pytest.approx(3.0 * projection_share(shape, S) / S)
    assert streamed.restore_row_ms == pytest.approx(0.25 * kv_mib / S)
    assert streamed.step_ms == pytest.approx(2.0 + 0.5 * kv_mib)
    assert (streamed.message_ms, streamed.layers) == (0.05, 7)
    assert split_costs(False).step_ms == pytest.approx(0.5 * kv_mib)
    with pytest.raises(ValueError, match=r"cut: must lie in \[1, 32\], got 0"):
        layer_split_costs(_inputs("llama-2-7b"), "int8", 0)


def test_the_projection_share_counts_the_fused_qkv_against_the_whole_layer():
    """SmolLM2-135M (d 576, 9 heads and 3 KV heads of 64, FFN 1,536) at 1,024 tokens: Q, K and V
    2·576·(576 + 2·3·64) flops a token, against those, O 2·576², the FFN 6·576·1,536 and
    attention 2·1,024·576."""
    qkv = 2 * 576 * (576 + 2 * 3 * 64)
    layer = qkv + 2 * 576 * 576 + 6 * 576 * 1536 + 2 * 1024 * 576
    assert projection_share(get_preset("smollm2-135m"), 1024) == pytest.approx(qkv / layer)


def test_the_brute_force_searches_the_grid_it_is_given():
    costs = LayerSplitCosts(input_row_ms=1.0, kv_row_ms=2.0, recompute_row_ms=0.5)
    assert brute_force_layer_split(costs, 1000, block=100) == 900


def test_only_plain_actions_of_the_wanted_codecs_are_split_and_keep_their_boundary():
    """int8 restored dearly and recomputed cheaply: its plain action at cut 16 takes an l > 0;
    the same cut with a token split, Lynx's streams or an l already, cut 0 and a codec not
    wanted are left out."""
    inputs = CostInputs(get_preset("llama-2-7b"), 4096, 5.0, 150.0,
                        codec_costs={"int8": CodecCost(0.0, 5.0)}, message_ms=0.05,
                        prefill_ms_per_layer=2.0, streamed=True, chunk_tokens=512,
                        layer_splits=True)
    assert best_layer_split(layer_split_costs(inputs, "int8", 16), 4096) > 0
    plain = Action("int8", 16, 32, boundary="splitzip")
    others = [Action("int8", 0, 32), Action("int8", 16, 32, split=256),
              Action(PROGRESSIVE_CODEC, 16, 32, progressive=True),
              Action("int8", 16, 32, layer_split=256)]
    (split,) = layer_split_actions(inputs, ["int8"], [*others[:2], plain, *others[2:]])
    assert split.layer_split > 0
    assert split == Action("int8", 16, 32, boundary="splitzip", layer_split=split.layer_split)
    assert not layer_split_actions(inputs, ["bf16"], [plain])


def test_the_closed_form_finds_an_optimum_only_one_crossing_points_to():
    """Two points where the grid's best l neighbours one crossing alone, off the grid: r = s at
    l = 3,000 (w = s at 1,849 and w = r at 2,276 point elsewhere), and w = s at l = 0.5, inside
    the first block (the other crossing points to the grid's last l)."""
    r_meets_s = LayerSplitCosts(input_row_ms=0.0, kv_row_ms=1.7e-3, recompute_row_ms=1.2e-3,
                                restore_row_ms=2e-4, step_ms=3.8192, layers=10)
    assert best_layer_split(r_meets_s, 4096) == brute_force_layer_split(r_meets_s, 4096) == 2816
    w_meets_s_at_once = LayerSplitCosts(input_row_ms=0.5, kv_row_ms=1.0,
                                        recompute_row_ms=0.7005, restore_row_ms=0.2,
                                        step_ms=1024 - 0.25, layers=10)
    assert best_layer_split(w_meets_s_at_once, 1024) == 256
    assert brute_force_layer_split(w_meets_s_at_once, 1024) == 256


def test_the_closed_form_searches_the_grid_it_is_given():
    costs = LayerSplitCosts(input_row_ms=1.0, kv_row_ms=2.0, recompute_row_ms=0.5)
    assert best_layer_split(costs, 1000, block=100) == 900


def test_one_message_at_l_0_two_above_and_the_slowest_stage_paces_the_rest():
    one = LayerSplitCosts(input_row_ms=1.0, kv_row_ms=2.0, recompute_row_ms=0.5,
                          message_ms=3.0)
    assert layer_split_time(one, 100, 0) == 2.0 * 100 + 3.0
    assert layer_split_time(one, 100, 10) == 1.0 * 10 + 2.0 * 90 + 2 * 3.0 + 0.5 * 10
    # three layers: s + w + r, then two more of the slowest stage, whichever it is
    step_bound = LayerSplitCosts(1.0, 1.0, 1.0, step_ms=500.0, layers=3)
    assert layer_split_time(step_bound, 100, 50) == 500.0 + 100 + 50 + 2 * 500.0
    recompute_bound = LayerSplitCosts(1.0, 1.0, 9.0, layers=3)
    assert layer_split_time(recompute_bound, 100, 50) == 100 + 450 + 2 * 450


def test_the_grid_and_the_time_model_name_what_is_out_of_range():
    assert allowed_layer_splits(1) == [0]
    assert allowed_layer_splits(3, block=1) == [0, 1, 2]
    for seq_len, block in ((0, 256), (5, 0)):
        with pytest.raises(ValueError, match=rf"^seq_len, block: must be positive, got "
                                             rf"{seq_len}, {block}$"):
            allowed_layer_splits(seq_len, block)
    with pytest.raises(ValueError, match=r"^restore_row_ms: must be >= 0, got -1.0$"):
        LayerSplitCosts(1.0, 1.0, 1.0, restore_row_ms=-1.0)
    with pytest.raises(ValueError, match=r"^layers: must be positive, got 0$"):
        LayerSplitCosts(1.0, 1.0, 1.0, layers=0)
    costs = LayerSplitCosts(input_row_ms=1.0, kv_row_ms=2.0, recompute_row_ms=0.5)
    for split in (-1, 100):
        with pytest.raises(ValueError, match=rf"^split: must lie in \[0, 100\), got {split}$"):
            layer_split_time(costs, 100, split)
