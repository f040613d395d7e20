"""The prefill scheduler's thread over the real model: prompts submitted together come out layer by
layer, each the lone prefill's bit for bit in invariant mode (to float64 rounding in the shared
mode), whatever ticks they shared; late, cancelled and failed prompts end with an error, never
silently."""

import threading

import pytest
import torch

from rekv_core.engine.prefill_scheduler import (Finished, LayerDone, PrefillScheduler,
                                                SchedulerClosed)
from rekv_core.model import prefill
from rekv_core.model.layer_batch import layer_forward_batch

# (length, through): one longer than the budget, so run in block pieces beside the others
PROMPTS = [(600, 30), (20, 7), (300, 12), (5, 1)]


def _ids(model, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.shape.vocab_size, (n,), generator=gen).tolist()


def _collect(job):
    events = list(job.events())
    assert isinstance(events[-1], Finished)
    layers = events[:-1]
    assert [e.index for e in layers] == list(range(len(layers)))
    assert all(isinstance(e, LayerDone) for e in layers)
    return layers, events[-1]


def _check(model, ids, through, layers, finished, same):
    ref = prefill(model, ids, boundaries=range(through + 1))
    assert len(layers) == through
    for event in layers:
        same(event.hidden_in, ref.hidden[event.index], f"h_{event.index}")
        same(event.keys, ref.keys[event.index], f"K of layer {event.index}")
        same(event.values, ref.values[event.index], f"V of layer {event.index}")
        same(event.hidden_out, ref.hidden[event.index + 1], f"h_{event.index + 1}")
    same(finished.hidden_out, ref.hidden[through], f"h_{through}")


def _equal(got, want, what):
    assert torch.equal(got, want), what


def _close(got, want, what):
    err = float((got - want).abs().max())
    assert err <= 1e-9 * float(want.abs().max()), f"{what}: off by {err:.3g}"


def _run_all(scheduler, model, same):
    """Submit PROMPTS together, close the scheduler once they are out, check each against its
    lone prefill with `same`; returns the scheduled prompts."""
    prompts = [(_ids(model, n, seed), through) for seed, (n, through) in enumerate(PROMPTS)]
    try:
        jobs = [scheduler.submit(ids, through) for ids, through in prompts]
        results = [_collect(job) for job in jobs]
    finally:
        scheduler.close()
    for (ids, through), (layers, finished) in zip(prompts, results):
        _check(model, ids, through, layers, finished, same)
    return jobs


@pytest.mark.parametrize("dtype_fixture", ["smollm_fp32", "smollm_bf16"])
def test_invariant_mode_gives_each_prompt_its_lone_prefill(request, dtype_fixture):
    model = request.getfixturevalue(dtype_fixture)
    _run_all(PrefillScheduler(model, token_budget=512, invariant=True), model, _equal)


def test_the_shared_mode_agrees_with_the_lone_prefill_to_rounding(smollm_fp64):
    calls = []

    def counting(model, index, segments, invariant):
        calls.append(len(segments))
        return layer_forward_batch(model, index, segments, invariant)

    scheduler = PrefillScheduler(smollm_fp64, token_budget=512, forward=counting)
    jobs = _run_all(scheduler, smollm_fp64, _close)
    assert max(calls) > 1, "prompts submitted together share a call"
    assert all(job.compute_s > 0 for job in jobs)


def _failing(model, index, segments, invariant):
    if index == 3:
        raise RuntimeError("out of memory at layer 3")
    return layer_forward_batch(model, index, segments, invariant)


@pytest.mark.parametrize("case", ["deadline", "forward"])
def test_a_prompt_that_cannot_finish_ends_with_an_error_and_the_other_goes_on(smollm_fp32,
                                                                             case):
    """Past its deadline (the scheduler's clock): a TimeoutError naming it; a forward that raises
    (at layer 3, which only the doomed prompt reaches): that error."""
    if case == "deadline":
        scheduler = PrefillScheduler(smollm_fp32, clock=lambda: 100.0)
        doomed, other = {"through": 4, "deadline": 99.0}, {"through": 2, "deadline": 200.0}
        error, match = TimeoutError, "transfer t-1: past its deadline"
    else:
        scheduler = PrefillScheduler(smollm_fp32, forward=_failing)
        doomed, other = {"through": 6}, {"through": 3}
        error, match = RuntimeError, "out of memory at layer 3"
    try:
        ended = scheduler.submit([1, 2, 3, 4], name="transfer t-1", **doomed)
        goes_on = scheduler.submit([5, 6], **other)
        with pytest.raises(error, match=match):
            list(ended.events())
        assert len(_collect(goes_on)[0]) == other["through"]
    finally:
        scheduler.close()


def test_cancelled_and_closed_prompts_end_and_the_others_finish(smollm_fp32):
    gate = threading.Event()

    def held(model, index, segments, invariant):
        gate.wait(30)
        return layer_forward_batch(model, index, segments, invariant)

    scheduler = PrefillScheduler(smollm_fp32, forward=held)
    first = scheduler.submit([1, 2, 3], through=2)
    dropped = scheduler.submit([4, 5], through=30)
    dropped.cancel()
    gate.set()
    assert len(_collect(first)[0]) == 2
    with pytest.raises(SchedulerClosed, match="cancelled"):
        list(dropped.events())
    gate.clear()
    waiting = scheduler.submit([7, 8, 9], through=30)
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    gate.set()
    closer.join(30)
    with pytest.raises(SchedulerClosed, match="closed"):
        list(waiting.events())
    with pytest.raises(SchedulerClosed):
        scheduler.submit([1], through=1)
    assert scheduler.queued == 0


def test_bad_submissions_are_named(smollm_fp32):
    scheduler = PrefillScheduler(smollm_fp32)
    try:
        with pytest.raises(ValueError, match=r"through: must lie in \[1, 30\], got 0"):
            scheduler.submit([1, 2], through=0)
        with pytest.raises(ValueError, match=r"through: must lie in \[1, 30\], got 31"):
            scheduler.submit([1, 2], through=31)
        with pytest.raises(ValueError, match="token_ids: id 49152 at position 1"):
            scheduler.submit([1, 49152], through=2)
    finally:
        scheduler.close()
    with pytest.raises(ValueError, match="token_budget: must be at least 1"):
        PrefillScheduler(smollm_fp32, token_budget=0)


@pytest.mark.parametrize("catch_up", [0, 8])
def test_a_prompt_arriving_a_layer_late_catches_up_and_shares_the_calls(smollm_fp32, catch_up):
    """The second prompt is submitted during the first's layer 0: with catch-up it runs layer 0
    alone while the first waits, and from layer 1 on every call holds both; without, the two stay
    a layer apart and never share a call."""
    calls, late = [], []

    def submitting(model, index, segments, invariant):
        calls.append((index, len(segments)))
        if not late:
            late.append(scheduler.submit(_ids(model, 16, 1), 6))
        return layer_forward_batch(model, index, segments, invariant)

    scheduler = PrefillScheduler(smollm_fp32, catch_up=catch_up, forward=submitting)
    try:
        first = scheduler.submit(_ids(smollm_fp32, 24, 0), 6)
        _collect(first), _collect(late[0])
    finally:
        scheduler.close()
    if catch_up:
        assert calls == [(0, 1), (0, 1)] + [(layer, 2) for layer in range(1, 6)]
    else:
        assert calls == [(0, 1)] + [(layer, 1) for pair in zip(range(1, 6), range(5))
                                    for layer in sorted(pair)] + [(5, 1)]
    with pytest.raises(ValueError, match="catch_up: must be >= 0 layers, got -1"):
        PrefillScheduler(smollm_fp32, catch_up=-1)
