"""The decode worker's quality canary: which handoffs it samples, the idle rule, waiting for idle,
the metrics and the window's log line (the model runs; no server)."""

import logging
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from rekv_core.connector import CanaryJudge
from rekv_core.handoff import Action
from rekv_core.model import KVCache, prefill
from services.decode import canary as canary_module
from services.decode.canary import Canary, CanarySettings, is_lossy, worker_idle
from services.metrics import CanaryMetrics
from services.settings import ServiceSettings

PROMPT = "The pass key is 31415. Remember it. 31415 is the pass key. What is the pass key? It is"
INT8 = Action("int8", 20, 30)


def _canary(model, registry: CollectorRegistry, idle, fraction: float = 1.0, window: int = 20,
            continuation: int = 4, rng=None) -> Canary:
    """A canary judged by the gate's criterion (no policy: 1.0)."""
    return Canary(model, CanarySettings(fraction, continuation), CanaryJudge(None, window),
                  CanaryMetrics(registry), idle, rng)


class _Draws:
    """A stand-in for `random.Random` that returns the given draws in turn."""

    def __init__(self, *draws: float):
        self.draws = list(draws)

    def random(self) -> float:
        return self.draws.pop(0)


def _count(registry: CollectorRegistry, outcome: str, action: Action = INT8) -> float:
    return registry.get_sample_value("rekv_canary_checks_total", {
        "codec": action.codec, "cut": str(action.cut), "outcome": outcome}) or 0.0


def _wait_for(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def handed(smollm_bf16, tokenizer):
    ids = tokenizer.encode(PROMPT)
    out = prefill(smollm_bf16, ids, boundaries=())

    def make(levels: bool = False):
        keys, values = list(out.keys), list(out.values)
        if levels:  # the prefix layers at five levels, as `coarse_codec` sends them
            from services.prefill.faults import coarsened
            keys = [coarsened(k) if i < INT8.cut else k for i, k in enumerate(keys)]
            values = [coarsened(v) if i < INT8.cut else v for i, v in enumerate(values)]
        return ids, KVCache.from_layers(keys, values, len(ids) + 6), out.logits
    return make


def test_only_lossy_handoffs_are_checked():
    assert is_lossy(INT8, fallback=False)
    assert not is_lossy(INT8, fallback=True)  # recomputed here: exact
    assert not is_lossy(Action("bf16", 20, 30), fallback=False)
    assert not is_lossy(Action("splitzip", 20, 30), fallback=False)
    assert not is_lossy(Action("int8", 0, 30), fallback=False)  # token-only


def test_idle_means_no_request_and_nothing_computing():
    assert worker_idle(0, 0)
    assert not worker_idle(1, 0)  # a request waiting or running
    assert not worker_idle(0, 1)  # generating, recomputing, or a handoff's suffix


def test_a_fraction_of_lossy_handoffs_is_sampled(smollm_bf16, handed):
    registry = CollectorRegistry()
    idle = threading.Event()  # never idle: the queued checks wait
    canary = _canary(smollm_bf16, registry, idle.is_set, fraction=0.25,
                     rng=_Draws(0.9, 0.1, 0.3, 0.2, 0.05))
    try:
        ids, cache, logits = handed()
        assert not canary.offer(Action("bf16", 20, 30), False, ids, cache, logits)  # no draw
        taken = [canary.offer(INT8, False, ids, cache, logits) for _ in range(5)]
        # drawn below 0.25: 0.1, 0.2 queued (MAX_PENDING of them), 0.05 found the queue full
        assert taken == [False, True, False, True, False]
        assert _count(registry, "not_sampled") == 2 and _count(registry, "busy") == 1
    finally:
        canary.close()
    off = _canary(smollm_bf16, CollectorRegistry(), lambda: True, fraction=0.0)
    assert not off.offer(INT8, False, *handed())
    off.close()


class _Gate:
    """Idle while open; `interrupt_after(n)`: closes itself after granting n more steps."""

    def __init__(self):
        self.open, self.granted, self.left = False, 0, None

    def __call__(self) -> bool:
        if self.open and self.left == 0:
            self.open = False  # a request arrived
        if self.open:
            self.granted += 1
            self.left = None if self.left is None else self.left - 1
        return self.open


def test_a_check_waits_for_idle_and_stops_when_a_request_arrives(smollm_bf16, handed):
    registry = CollectorRegistry()
    gate = _Gate()
    canary = _canary(smollm_bf16, registry, gate)
    try:
        assert canary.offer(INT8, False, *handed())
        time.sleep(0.3)
        assert gate.granted == 0 and _count(registry, "agree") == 0  # busy: nothing ran
        gate.left, gate.open = 3, True
        time.sleep(0.5)
        # three steps ran, then it waited: not finished, and not computing
        assert gate.granted == 3 and _count(registry, "agree") == 0
        assert registry.get_sample_value("rekv_canary_seconds_count") == 0
        gate.left, gate.open = None, True
        _wait_for(lambda: _count(registry, "agree") == 1)
        assert gate.granted > smollm_bf16.shape.num_layers  # one grant per step
        assert registry.get_sample_value("rekv_canary_seconds_count") == 1
        labels = {"codec": "int8", "cut": "20"}
        assert registry.get_sample_value("rekv_canary_window_agreement_ratio", labels) == 1.0
    finally:
        canary.close()


def test_a_check_never_idle_in_time_is_dropped_as_busy(smollm_bf16, handed, monkeypatch):
    monkeypatch.setattr(canary_module, "MAX_WAIT_S", 0.1)
    registry = CollectorRegistry()
    canary = _canary(smollm_bf16, registry, lambda: False)
    try:
        assert canary.offer(INT8, False, *handed())
        _wait_for(lambda: _count(registry, "busy") == 1, timeout_s=10)
        assert _count(registry, "agree") + _count(registry, "disagree") == 0
    finally:
        canary.close()


def test_a_broken_codec_is_flagged_once_its_window_fills(smollm_bf16, handed, caplog):
    registry = CollectorRegistry()
    canary = _canary(smollm_bf16, registry, lambda: True, window=2)
    caplog.set_level(logging.INFO, logger="rekv.decode.canary")
    try:
        for expected in (1, 2):
            assert canary.offer(INT8, False, *handed(levels=True))
            _wait_for(lambda: _count(registry, "disagree") == expected)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "int8/20 top-1 agreement" in warnings[0]
        assert "below the gate's 1.000" in warnings[0]
        labels = {"codec": "int8", "cut": "20"}
        assert registry.get_sample_value("rekv_canary_window_agreement_ratio", labels) < 0.9
        assert registry.get_sample_value("rekv_canary_kl_divergence_count", labels) == 2
        for expected in (1, 2):  # healthy again: it recovers
            assert canary.offer(INT8, False, *handed())
            _wait_for(lambda: _count(registry, "agree") == expected)
        assert any("is back within the gate's" in r.getMessage() for r in caplog.records)
    finally:
        canary.close()


@pytest.mark.parametrize("field, value", [("canary_fraction", 1.5), ("canary_fraction", -0.1),
                                          ("canary_window", 0), ("canary_continuation", -1)])
def test_bad_canary_settings_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        ServiceSettings(role="decode", prefill_address="127.0.0.1:1", plaintext=True,
                        **{field: value})
    settings = ServiceSettings.from_args("decode", ["--prefill-address", "127.0.0.1:1",
                                                    "--plaintext", "true"])
    assert (settings.canary_fraction, settings.canary_window) == (0.02, 20)
