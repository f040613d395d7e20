"""The prefill scheduler's policy: budgeted, block-aligned picks; the least work left first; the
oldest prompt never starves."""

import random

import pytest

from rekv_core.engine.prefill_tick import Progress, plan_tick
from rekv_core.model.blocks import EXEC_BLOCK


def _run_tick(prompts, budget, catch_up=0):
    picks = plan_tick(prompts, budget, catch_up)
    for pick in picks:
        assert pick.layer == pick.progress.layer and pick.r0 == pick.progress.row
        pick.progress.advance(pick.r1 - pick.r0)
    return picks


def test_a_short_prompt_shares_the_tick_and_the_oldest_keeps_a_block():
    long_, short, middle = Progress(0, 1000, 30), Progress(1, 10, 30), Progress(2, 300, 30)
    picks = plan_tick([long_, short, middle], budget=512)
    got = {p.progress.seq: (p.r0, p.r1) for p in picks}
    # the short prompt whole; the middle one (300 rows) fits neither whole nor as a block in the
    # 246 rows left beside the oldest's reserved block; the oldest gets its block
    assert got == {0: (0, EXEC_BLOCK), 1: (0, 10)}


def test_the_least_work_left_goes_first_and_takes_what_fits():
    a, b, c = Progress(0, 40, 30), Progress(1, 600, 2), Progress(2, 600, 30)
    picks = plan_tick([a, b, c], budget=1100)
    got = {p.progress.seq: (p.r0, p.r1) for p in picks}
    # a, the oldest and with the least work left: whole; then b (1,200 row-layers, as a, but
    # younger): whole, 600 rows; c: one block of the 460 rows left
    assert got == {0: (0, 40), 1: (0, 600), 2: (0, EXEC_BLOCK)}


def test_a_budget_below_a_block_still_lets_one_block_through():
    p = Progress(0, 1000, 3)
    assert [(x.r0, x.r1) for x in plan_tick([p], budget=10)] == [(0, EXEC_BLOCK)]
    q = Progress(0, 7, 3)
    assert [(x.r0, x.r1) for x in plan_tick([q], budget=3)] == [(0, 7)]


def test_finished_prompts_get_nothing_and_a_bad_budget_is_named():
    done = Progress(0, 10, 2, layer=2)
    assert plan_tick([done], budget=64) == []
    with pytest.raises(ValueError, match="budget: must be at least one row"):
        plan_tick([Progress(0, 10, 2)], budget=0)
    with pytest.raises(ValueError, match="catch_up: must be >= 0 layers, got -1"):
        plan_tick([], budget=64, catch_up=-1)


@pytest.mark.parametrize("seed", range(6))
def test_every_tick_is_budgeted_and_aligned_and_every_prompt_finishes(seed):
    rng = random.Random(seed)
    budget = rng.choice([100, EXEC_BLOCK, 700, 2048])
    prompts = [Progress(i, rng.randint(1, 1500), rng.randint(1, 30)) for i in range(8)]
    ticks = 0
    while any(not p.done for p in prompts):
        layers_before = {p.seq: p.layer for p in prompts}
        picks = _run_tick(prompts, budget)
        assert picks, "a tick with prompts left picks some"
        assert len({p.progress.seq for p in picks}) == len(picks)
        assert sum(p.r1 - p.r0 for p in picks) <= max(budget, EXEC_BLOCK)
        for pick in picks:
            assert pick.r0 % EXEC_BLOCK == 0
            assert pick.r1 == pick.progress.rows or pick.r1 % EXEC_BLOCK == 0
        oldest = min((p for p in prompts if layers_before[p.seq] < p.through), default=None,
                     key=lambda p: p.seq)
        assert oldest is None or any(pick.progress is oldest for pick in picks)
        ticks += 1
        assert ticks < 100_000
    total = sum(p.rows * p.through for p in prompts)
    assert ticks >= total / max(budget, EXEC_BLOCK)


def test_a_short_prompt_submitted_later_finishes_before_a_long_one():
    long_ = Progress(0, 2048, 30)
    ticks = [_run_tick([long_], 512) for _ in range(3)]
    assert all(ticks)
    short = Progress(1, 32, 30)
    n = 0
    while not short.done:
        _run_tick([long_, short], 512)
        n += 1
    assert n == 30 and not long_.done  # one layer of the short prompt every tick


def _arrivals(catch_up, n=8, rows=32, layers=30):
    """`n` prompts of `rows` rows, one arriving per tick; the layers each tick ran at."""
    prompts, layers_per_tick = [], []
    for tick in range(200):
        if len(prompts) < n:
            prompts.append(Progress(len(prompts), rows, layers))
        picks = _run_tick(prompts, 2048, catch_up)
        if not picks:
            return prompts, layers_per_tick
        layers_per_tick.append(sorted(pick.layer for pick in picks))
    raise AssertionError("the prompts never finished")


def test_late_short_arrivals_catch_up_and_then_share_every_call():
    prompts, ticks = _arrivals(catch_up=8)
    # from the tick the last one arrived, the late ones run alone at their lowest layer; once met
    # (7 ticks later), every tick is one call of all eight prompts
    met = next(i for i, t in enumerate(ticks) if i >= 7 and len(t) == 8 and len(set(t)) == 1)
    assert all(len(set(t)) == 1 for t in ticks[7:])
    assert all(len(t) == 8 for t in ticks[met:])
    assert len(ticks) == met + 30 - ticks[met][0]
    # without it, the eight stay a layer apart: eight calls a tick while all are in flight
    _, apart = _arrivals(catch_up=0)
    assert max(len(set(t)) for t in apart) == 8 and len(apart) == 30 + 7


def test_a_prompt_waits_at_most_catch_up_ticks_however_many_arrive():
    first = Progress(0, 32, 30)
    prompts, ticks = [first], 0
    while not first.done:
        prompts.append(Progress(len(prompts), 32, 30))  # one more every tick, forever
        _run_tick(prompts, 1 << 20, catch_up=5)
        ticks += 1
        assert ticks < 100, "held forever"
    assert first.held == 5 and ticks == 30 + 5


def test_a_long_late_arrival_or_a_wide_gap_holds_no_one():
    ahead = Progress(0, 32, 30, layer=3)
    long_ = Progress(1, EXEC_BLOCK + 1, 30)  # more than a block left at its layer
    assert {p.progress.seq for p in plan_tick([ahead, long_], 4096, catch_up=8)} == {0, 1}
    two_short = [Progress(1, 200, 30), Progress(2, 57, 30)]  # 257 rows together: no hold either
    assert len(plan_tick([ahead, *two_short], 4096, catch_up=8)) == 3
    far = Progress(0, 32, 30, layer=9)  # 9 layers ahead of a catch-up of 8
    assert len(plan_tick([far, Progress(1, 32, 30)], 4096, catch_up=8)) == 2
    assert ahead.held == 0 and far.held == 0
    one_block = Progress(1, EXEC_BLOCK, 30)  # exactly a block: cheap enough to catch up
    assert [p.progress.seq for p in plan_tick([ahead, one_block], 4096, 8)] == [1]
    near = Progress(0, 32, 30, layer=8)
    picks = plan_tick([near, Progress(1, 32, 30)], 4096, catch_up=8)
    assert [p.progress.seq for p in picks] == [1] and near.held == 1
