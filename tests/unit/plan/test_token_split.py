"""KVPR's token split: the closed form's l equals a brute-force search of the same time model over
random costs and prompt lengths, the model's ends are the actions they stand for, and a token
cheaper sent as KV than as its boundary row is never recomputed."""

import random

import pytest

from rekv_core.model.blocks import EXEC_BLOCK
from rekv_core.plan.token_split import (SplitCosts, allowed_splits, best_split,
                                        brute_force_split, crossing, split_time)


def _random_costs(rng: random.Random) -> SplitCosts:
    return SplitCosts(boundary_row_ms=rng.choice([0.0, rng.uniform(0, 0.05)]),
                      suffix_row_ms=rng.uniform(0, 0.2), recompute_row_ms=rng.uniform(0, 0.3),
                      prefix_ms=rng.choice([0.0, rng.uniform(0, 500)]))


@pytest.mark.parametrize("block", [1, 16, EXEC_BLOCK])
def test_the_closed_form_equals_the_brute_force(block):
    rng = random.Random(block)
    for _ in range(400):
        costs, seq_len = _random_costs(rng), rng.randint(1, 5000)
        assert best_split(costs, seq_len, block) == brute_force_split(costs, seq_len, block), (
            costs, seq_len)


def test_between_two_grid_points_the_crossing_decides():
    costs = SplitCosts(boundary_row_ms=0.01, suffix_row_ms=0.1, recompute_row_ms=0.1)
    assert crossing(costs, 2048) == pytest.approx(1024)
    assert best_split(costs, 2048) == 1024
    assert best_split(costs, 2048, block=1) == 1024
    heavy_prefix = SplitCosts(0.01, 0.1, 0.1, prefix_ms=1e6)  # the wire is long: recompute all
    assert best_split(heavy_prefix, 2048) == 2048


def test_a_boundary_row_dearer_than_its_kv_is_never_sent():
    costs = SplitCosts(boundary_row_ms=0.2, suffix_row_ms=0.1, recompute_row_ms=0.0)
    assert best_split(costs, 4096) == 0 == brute_force_split(costs, 4096)


def test_the_ends_are_the_joint_action_and_the_whole_transfer():
    costs = SplitCosts(boundary_row_ms=0.01, suffix_row_ms=0.1, recompute_row_ms=0.05,
                       prefix_ms=30.0)
    s = 1000
    assert split_time(costs, s, s) == pytest.approx(0.01 * s + max(0.05 * s, 30.0))
    assert split_time(costs, s, 0) == pytest.approx(0.1 * s + 30.0)
    assert allowed_splits(600) == [0, 256, 512, 600]
    with pytest.raises(ValueError, match="split"):
        split_time(costs, s, s + 1)
    with pytest.raises(ValueError, match="recompute_row_ms"):
        SplitCosts(0.1, 0.1, -1.0)


def test_the_planners_inputs_move_the_split_the_right_way():
    """From `CostInputs`: a slower link or a cheaper recompute recomputes more rows, a faster link
    or a dearer recompute fewer; the per-token costs are the bytes and γ spread over the prompt."""
    from rekv_core.model.shapes import get_preset
    from rekv_core.plan.cost import CostInputs
    from rekv_core.plan.cost import split_costs

    shape, s = get_preset("smollm2-135m"), 4096

    def split(gbps, gamma):
        inputs = CostInputs(shape, s, link_gbps=gbps, suffix_ms_per_layer=gamma)
        return best_split(split_costs(inputs, "int8", 10), s)

    costs = split_costs(CostInputs(shape, s, link_gbps=8.0, suffix_ms_per_layer=40.0), "bf16", 10)
    per_ms = 8e9 / 8 / 1e3
    assert costs.boundary_row_ms == pytest.approx(shape.hidden_size * 2 / per_ms)
    assert costs.suffix_row_ms == pytest.approx(20 * 2 * shape.num_kv_heads * shape.head_dim * 2
                                                / per_ms)
    assert costs.recompute_row_ms == pytest.approx(20 * 40.0 / s)
    assert costs.prefix_ms == pytest.approx(10 * shape.kv_layer_bytes(s) / per_ms)
    assert split(1.0, 40.0) >= split(10.0, 40.0) >= split(100.0, 40.0)
    assert split(10.0, 10.0) >= split(10.0, 40.0) >= split(10.0, 400.0)
    assert split(0.1, 1.0) == s and split(1000.0, 4000.0) < s
    with pytest.raises(ValueError, match="cut"):
        split_costs(CostInputs(shape, s, link_gbps=8.0, suffix_ms_per_layer=40.0), "bf16", 0)


def test_a_boundary_row_as_dear_as_its_kv_row_is_not_sent_though_a_later_l_ties():
    """a = b: T(l) >= T(0) for every l, equal where the wire bounds (768 here); the tie goes to
    the smaller l, so nothing is recomputed."""
    costs = SplitCosts(boundary_row_ms=1.0, suffix_row_ms=1.0, recompute_row_ms=0.1)
    assert split_time(costs, 1024, 768) == split_time(costs, 1024, 0)
    assert best_split(costs, 1024, 256) == brute_force_split(costs, 1024, 256) == 0


def test_the_crossing_is_where_recompute_meets_the_wire_and_all_of_s_when_neither_costs():
    costs = SplitCosts(boundary_row_ms=0.0, suffix_row_ms=0.5, recompute_row_ms=0.5)
    assert crossing(costs, 1000) == 500.0  # g + b = 1
    free = SplitCosts(boundary_row_ms=0.0, suffix_row_ms=0.0, recompute_row_ms=0.0)
    assert crossing(free, 1000) == 1000.0


def test_bad_lengths_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="seq_len: must be positive, got 0"):
        allowed_splits(0)
    with pytest.raises(ValueError, match="block: must be positive, got 0"):
        best_split(SplitCosts(0.0, 1.0, 1.0), 512, block=0)
