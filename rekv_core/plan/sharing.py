"""How many requests shared the decode worker's compute over a past interval.

A suffix that runs while two other requests compute beside it takes about three times its own
compute on a core (or a stream) they share. The calibration learns the worker's speed from suffix
times, so it must divide each by how many requests were computing *while it ran*: the count when
the handoff was negotiated says little about that (the others may still be waiting for their own
prefills, or be done by then).

`SharingMeter(count)` samples `count()` (the requests computing now, the measured one included)
every `period_s` on a daemon thread (`sample()`; with `start=False` the caller samples) and keeps
the running integral for `history_s`. `average(t0, t1)` is the mean count over [t0, t1] (times of
`clock`, `time.perf_counter` by default), from the integral; an interval shorter than two periods,
or older than the history, gets the count now.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)


class SharingMeter:
    def __init__(self, count: Callable[[], int], period_s: float = 0.01,
                 history_s: float = 300.0, clock: Callable[[], float] = time.perf_counter,
                 start: bool = True):
        self._count, self._period, self._clock = count, period_s, clock
        self._times: deque[float] = deque(maxlen=max(2, int(history_s / period_s)))
        self._integrals: deque[float] = deque(maxlen=self._times.maxlen)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._times.append(clock())
        self._integrals.append(0.0)
        self._thread = None
        if start:
            self._thread = threading.Thread(target=self._run, name="rekv-sharing", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self.sample()
            except Exception:  # keep sampling; one bad read must not end the meter
                log.exception("sharing meter: counting failed")

    def sample(self) -> None:
        """Add the count now, held since the last sample, to the integral."""
        count = self._count()
        now = self._clock()
        with self._lock:
            integral = self._integrals[-1] + count * (now - self._times[-1])
            self._times.append(now)
            self._integrals.append(integral)

    def average(self, t0: float, t1: float) -> float:
        """Mean number of requests computing over [t0, t1] (at least the count now when the
        interval is too short or too old to tell)."""
        with self._lock:
            times, integrals = list(self._times), list(self._integrals)
        end = min(t1, times[-1])
        if end - t0 < 2 * self._period or t0 < times[0]:
            return float(self._count())
        return (_integral_at(times, integrals, end) - _integral_at(times, integrals, t0)) / (
            end - t0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


def _integral_at(times: list[float], integrals: list[float], t: float) -> float:
    """The integral at `t`, linear between samples."""
    i = bisect.bisect_right(times, t)
    if i == 0:
        return integrals[0]
    if i == len(times):
        return integrals[-1]
    t0, t1 = times[i - 1], times[i]
    return integrals[i - 1] + (integrals[i] - integrals[i - 1]) * (t - t0) / (t1 - t0)
