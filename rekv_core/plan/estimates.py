"""Running estimates that move with what is observed: link rate, per-MiB costs, layer costs.

`Ewma` is an exponentially weighted mean seeded with a prior. `LinkEstimate` is the median rate of
the last `window` (bytes, seconds) samples, so one disturbed sample does not move it and a real
change of link does within half a window; samples under `min_bytes` say more about latency than rate
and are skipped. Before its first sample it has no rate (`gbps` is None): whoever needs one then
says which prior it takes (`LINK_PRIOR_GBPS`, the services' `link_gbps` setting, by default).
`LayerCost` is the suffix cost of one layer as a function of prompt length, measured at a few
lengths and interpolated (piecewise linear in S; beyond the last point it extrapolates along a
quadratic through the origin, since attention grows with S²).
"""

from __future__ import annotations

import bisect
import collections
import statistics
import threading
from collections.abc import Sequence

from rekv_core.units import MiB

LINK_PRIOR_GBPS = 10.0  # the link rate assumed before anything was measured (a setting's default)


class Ewma:
    def __init__(self, prior: float, weight: float = 0.3):
        if not 0 < weight <= 1:
            raise ValueError(f"weight: must lie in (0, 1], got {weight}")
        self.value = prior
        self.weight = weight
        self.samples = 0
        self._lock = threading.Lock()

    def update(self, sample: float) -> float:
        with self._lock:
            self.value = sample if self.samples == 0 else (
                self.weight * sample + (1 - self.weight) * self.value)
            self.samples += 1
            return self.value


class LinkEstimate:
    def __init__(self, min_bytes: int = MiB, window: int = 8):
        self._rates: collections.deque[float] = collections.deque(maxlen=window)
        self.samples = 0
        self.min_bytes = min_bytes
        self._lock = threading.Lock()

    @property
    def gbps(self) -> float | None:
        """The median of the recent samples, Gb/s; None before the first."""
        with self._lock:
            return statistics.median(self._rates) if self._rates else None

    @property
    def measured(self) -> bool:
        return self.samples > 0

    def or_prior(self, prior_gbps: float) -> float:
        """The estimate, or `prior_gbps` before the first sample."""
        gbps = self.gbps
        return prior_gbps if gbps is None else gbps

    def observe(self, nbytes: int, seconds: float) -> float | None:
        """Take a sample (kept when it carries at least `min_bytes`); the estimate after it."""
        if nbytes >= self.min_bytes and seconds > 0:
            with self._lock:
                self._rates.append(nbytes * 8 / seconds / 1e9)
                self.samples += 1
        return self.gbps


class LayerCost:
    def __init__(self, lengths: Sequence[int], ms: Sequence[float]):
        if len(lengths) != len(ms) or not lengths:
            raise ValueError("layer cost: need one time per length, at least one")
        pairs = sorted(zip(lengths, ms))
        self.lengths = [p[0] for p in pairs]
        self.ms = [p[1] for p in pairs]

    def at(self, prompt_len: int) -> float:
        xs, ys = self.lengths, self.ms
        if prompt_len <= xs[0]:
            return ys[0]
        if prompt_len >= xs[-1]:
            s = prompt_len / xs[-1]
            return ys[-1] * s * s if len(xs) == 1 else ys[-1] * (s + (s * s - s) * self._curve())
        i = bisect.bisect_left(xs, prompt_len)
        t = (prompt_len - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + t * (ys[i] - ys[i - 1])

    def _curve(self) -> float:
        """Share of the last measured segment's growth that is faster than linear (0..1)."""
        (x0, x1), (y0, y1) = self.lengths[-2:], self.ms[-2:]
        if y0 <= 0 or x1 <= x0:
            return 0.0
        linear = y0 * x1 / x0
        quadratic = y0 * (x1 / x0) ** 2
        if quadratic <= linear:
            return 0.0
        return min(1.0, max(0.0, (y1 - linear) / (quadratic - linear)))

    def as_dict(self) -> dict:
        return {"lengths": self.lengths, "ms": self.ms}
