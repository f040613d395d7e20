"""The live quality canary: lossy handoffs checked against a recomputed reference while idle.

The quality gate judges actions on a sample before deployment; traffic drifts. `Canary.offer(ids,
handed)`, called once a request has finished decoding, samples a `canary_fraction` of the lossy
handoffs (a lossy codec at a cut > 0, not a fallback) and queues each sampled one (its token ids,
cache and first-token logits; at most `MAX_PENDING`, the next counted `busy`). One background
thread runs the queued checks (`rekv_core.plan.canary.canary_steps`: the prompt recomputed from
its token ids, then both caches compared at the first decoded position and over a short greedy
continuation) one step at a time (a layer over a chunk of rows, or a decode step), and only while
the worker is idle (`worker_idle`: no request waiting or running, nothing computing in
`DecodeLoad`): whenever a request arrives it stops before its next step and waits, so that it never
delays a user's token by more than one such step. A check that waited `MAX_WAIT_S` is dropped and
counted `busy`.

Per action (codec, cut): `rekv_canary_checks_total{codec,cut,outcome}` (agree: every position's
top-1 agrees; disagree; and the skipped: not_sampled, busy), the KL divergence at the first decoded
position (`rekv_canary_kl_divergence`), each check's share of agreeing positions
(`rekv_canary_top1_agreement_ratio`) and the agreement over the positions of each action's last
`canary_window` checks (`rekv_canary_window_agreement_ratio`); `rekv_canary_seconds`, the compute
of each check. A WARNING names the action once the agreement over a full window is below the
gate's threshold (`rekv_core.plan.canary.AgreementWindow`, `agreement_threshold`), an INFO once
it recovers.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rekv_core.connector import CanaryJudge, CanaryResult, canary_steps
from rekv_core.handoff import Action
from rekv_core.model import KVCache, Model
from services.decode.worker import DecodeWorker
from services.metrics import CanaryMetrics

log = logging.getLogger("rekv.decode.canary")

MAX_PENDING = 2  # sampled checks waiting (each holds its request's cache)
MAX_WAIT_S = 60.0  # a check that has not found the worker idle for this long is dropped
POLL_S = 0.01  # how often a waiting check looks whether the worker is idle


def worker_idle(requests: int, computing: int) -> bool:
    """Idle: no request waiting or running (`requests`), nothing computing (`computing`: what the
    decode load book counts, `DecodeLoad.computing`)."""
    return requests == 0 and computing == 0


def is_lossy(action: Action, fallback: bool) -> bool:
    """A handoff whose cache is not exactly the prefill's: what the canary checks."""
    return not fallback and not action.lossless


@dataclass(frozen=True)
class CanarySettings:
    fraction: float = 0.02  # of the lossy handoffs, checked
    continuation: int = 8  # greedy tokens compared beyond the first decoded position (0: none)


@dataclass
class _Job:
    action: Action
    ids: list[int]
    cache: KVCache
    logits: torch.Tensor
    queued: float  # monotonic


class Canary:
    def __init__(self, model: Model, settings: CanarySettings, judge: CanaryJudge,
                 metrics: CanaryMetrics, idle: Callable[[], bool],
                 rng: random.Random | None = None):
        self.model, self.settings, self.judge, self.idle = model, settings, judge, idle
        self.metrics = metrics
        self.rng = rng or random.Random()
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=MAX_PENDING)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rekv-canary", daemon=True)
        if settings.fraction > 0:
            log.info("quality canary on: %.3g of lossy handoffs, judged over %d checks per "
                     "action", settings.fraction, judge.window)
            self._thread.start()

    def offer(self, action: Action, fallback: bool, ids: list[int], cache: KVCache,
              logits: torch.Tensor) -> bool:
        """A finished request's handoff; True when a check of it was queued. Any thread."""
        if not is_lossy(action, fallback) or self.settings.fraction <= 0:
            return False
        labels = (action.codec, str(action.cut))
        if self.rng.random() >= self.settings.fraction:
            self.metrics.checks.labels(*labels, "not_sampled").inc()
            return False
        try:
            self._jobs.put_nowait(_Job(action, ids, cache, logits, time.monotonic()))
        except queue.Full:
            self.metrics.checks.labels(*labels, "busy").inc()
            return False
        return True

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            try:
                self._jobs.put_nowait(None)
            except queue.Full:
                pass  # the thread sees `_closed` at its next step or wait
            self._thread.join()

    def _run(self) -> None:
        while not self._closed.is_set():
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._check(job)
            except Exception:  # a broken check must never take the worker down
                log.exception("canary check of %s/%d failed", job.action.codec, job.action.cut)

    def _wait_idle(self, job: _Job) -> bool:
        while not self.idle():
            if self._closed.is_set() or time.monotonic() - job.queued > MAX_WAIT_S:
                return False
            time.sleep(POLL_S)
        return not self._closed.is_set()

    def _check(self, job: _Job) -> None:
        labels = (job.action.codec, str(job.action.cut))
        steps = canary_steps(self.model, job.ids, job.cache, job.logits,
                             self.settings.continuation)
        compute_s = 0.0
        while True:
            if not self._wait_idle(job):
                steps.close()
                self.metrics.checks.labels(*labels, "busy").inc()
                return
            started = time.perf_counter()
            try:
                next(steps)
            except StopIteration as done:
                result = done.value
                break
            finally:
                compute_s += time.perf_counter() - started
        self.metrics.seconds.observe(compute_s)
        self._record(job.action, result)

    def _record(self, action: Action, result: CanaryResult) -> None:
        labels = (action.codec, str(action.cut))
        m = self.metrics
        m.checks.labels(*labels, "agree" if result.agrees else "disagree").inc()
        m.kl.labels(*labels).observe(result.kl)
        m.agreement.labels(*labels).observe(result.agreement)
        window, change = self.judge.add(action, result)
        m.window.labels(*labels).set(window.agreement or 0.0)
        if change is not None and change.below:
            log.warning("canary: %s/%d top-1 agreement %.3f over the last %d checks is below the "
                        "gate's %.3f (mean KL %.4f)", action.codec, action.cut, change.agreement,
                        self.judge.window, window.threshold, change.mean_kl)
        elif change is not None:
            log.info("canary: %s/%d top-1 agreement %.3f over the last %d checks is back within "
                     "the gate's %.3f", action.codec, action.cut, change.agreement,
                     self.judge.window, window.threshold)


def build_canary(worker: DecodeWorker, requests: Callable[[], int]) -> Canary:
    """The worker's canary, judged by its policy (`policy`, else the one shipped for the model);
    `requests`: the calls waiting or running now."""
    s = worker.settings
    load = worker.connector.load
    return Canary(worker.model, CanarySettings(s.canary_fraction, s.canary_continuation),
                  CanaryJudge.for_model(worker.shape.name, s.policy, s.canary_window),
                  worker.metrics.canary, lambda: worker_idle(requests(), load.computing()))
