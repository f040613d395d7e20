"""Streamed handoffs whose prefill the scheduler computes, several at once sharing its ticks: each
rebuilds the cache a `LivePrefill` handoff rebuilds (the lone prefill's, through the codec), in
the same message order; a source closed early cancels its prompt and releases once."""

import threading

import pytest
import torch

from rekv_core.codecs import get_codec
from rekv_core.engine.prefill_scheduler import PrefillScheduler
from rekv_core.handoff import Action, wire_bytes
from rekv_core.handoff.scheduled_source import ScheduledPrefillSource
from rekv_core.handoff.source import LivePrefill
from rekv_core.model import prefill
from tests.support.inprocess_handoff import MessageNames, run_handoff

# (codec, cut, split, layer_split, prompt length): layer order, token-only, a token split and
# KVPR's per-layer form, prompts longer and shorter than the scheduler's budget
ACTIONS = [("bf16", 11, 0, 0, 520), ("int8", 30, 0, 0, 300), ("bf16", 0, 0, 0, 40),
           ("int4", 29, 0, 0, 64), ("bf16", 9, 256, 0, 600), ("bf16", 30, 0, 256, 520)]


def _ids(n, seed):
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check_cache(model, ids, action, result):
    ref = prefill(model, ids)
    codec = get_codec(action.codec)
    for layer in range(model.shape.num_layers):
        k, v = result.cache.layer(layer)
        if layer >= action.cut or codec.lossless or action.split:
            assert torch.equal(k, ref.keys[layer]) and torch.equal(v, ref.values[layer]), layer
        else:  # exactly what the codec makes of the prefill's layer
            rk, rv = codec.decode(codec.encode(ref.keys[layer], ref.values[layer]))
            assert torch.equal(k, rk.to(k.dtype)) and torch.equal(v, rv.to(v.dtype)), layer


def test_handoffs_side_by_side_rebuild_what_a_live_prefill_rebuilds(smollm_bf16):
    model = smollm_bf16  # BF16 on the wire is exact for a BF16 model
    L = model.shape.num_layers
    scheduler = PrefillScheduler(model, token_budget=512, invariant=True)
    outcomes = {}

    def one(i, codec, cut, split, layer_split, n):
        ids = _ids(n, seed=i)
        action = Action(codec, cut, L, split=split, layer_split=layer_split)
        released = []
        source = ScheduledPrefillSource(scheduler, ids, cut, action.sent_layers, layer_split,
                                        name=f"handoff {i}", on_done=lambda: released.append(1))
        names = MessageNames()
        result, errors = run_handoff(model, ids, action, source, 256, hooks=names)
        live_names = MessageNames()
        run_handoff(model, ids, action, LivePrefill(model, ids, cut, through=action.sent_layers,
                                                    input_rows=layer_split), 256,
                    hooks=live_names)
        outcomes[i] = (ids, action, result, errors, names.names, live_names.names, released,
                       source.compute_s)

    try:
        threads = [threading.Thread(target=one, args=(i, *a)) for i, a in enumerate(ACTIONS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
    finally:
        scheduler.close()
    assert sorted(outcomes) == list(range(len(ACTIONS)))
    for i, (ids, action, result, errors, names, live, released, compute_s) in outcomes.items():
        assert not errors, (i, errors)
        assert names == live, i
        assert released == [1], i
        assert result.bytes == wire_bytes(action, model.shape, len(ids)), i
        assert (compute_s > 0) == (action.sent_layers > 0), i
        _check_cache(model, ids, action, result)


def test_a_source_closed_early_cancels_its_prompt(smollm_fp32):
    model = smollm_fp32
    scheduler = PrefillScheduler(model)
    try:
        released = []
        source = ScheduledPrefillSource(scheduler, _ids(300, 1), 20,
                                        on_done=lambda: released.append(1))
        layers = source.layers()
        first = next(layers)
        assert first.index == 0
        with pytest.raises(RuntimeError, match="boundary: the prefill has not reached the cut"):
            source.boundary()
        layers.close()
        source.close()
        assert released == [1]
        for _ in range(200):
            if scheduler.queued == 0:
                break
            threading.Event().wait(0.05)
        assert scheduler.queued == 0
        with pytest.raises(RuntimeError, match="head: the prefill has not reached"):
            source.head()
    finally:
        scheduler.close()


def test_bad_cuts_are_named(smollm_fp32):
    scheduler = PrefillScheduler(smollm_fp32)
    try:
        with pytest.raises(ValueError, match=r"cut: must lie in \[0, 30\], got 31"):
            ScheduledPrefillSource(scheduler, [1, 2], 31)
        with pytest.raises(ValueError, match=r"through: must lie in \[5, 30\], got 4"):
            ScheduledPrefillSource(scheduler, [1, 2], 5, through=4)
        assert scheduler.queued == 0
    finally:
        scheduler.close()
