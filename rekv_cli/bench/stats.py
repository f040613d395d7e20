"""Summary statistics for benchmark samples: the median and its percentile-bootstrap interval.

`median_ci(samples, level=0.95, resamples=2000, seed=0)` returns (median, (low, high)): the median
of the samples and the `level` central interval of the medians of `resamples` resamples drawn with
replacement. The seed is fixed so a committed result can be recomputed from its samples.

`paired_ratio(numerators, denominators)` is the same for the ratios of samples taken in the same
round (a benchmark that runs every case once per round): a drift of the machine's speed between
rounds, which moves both samples of a round alike, cancels in each ratio, where it widens the
spread of each case's own samples. (A benchmark that picks the better of several cases by their
medians and then pairs it does not widen the interval for that choice.)
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence


def median_ci(samples: Sequence[float], level: float = 0.95, resamples: int = 2000,
              seed: int = 0) -> tuple[float, tuple[float, float]]:
    if not samples:
        raise ValueError("samples: need at least one value")
    if not 0 < level < 1:
        raise ValueError(f"level: must lie in (0, 1), got {level}")
    values = list(samples)
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    tail = (1 - level) / 2
    low = medians[int(tail * (resamples - 1))]
    high = medians[int(round((1 - tail) * (resamples - 1)))]
    return statistics.median(values), (low, high)


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float],
                 level: float = 0.95) -> tuple[float, tuple[float, float]]:
    """The median of the per-round ratios numerators[i] / denominators[i] and its interval."""
    if len(numerators) != len(denominators):
        raise ValueError(f"samples: need one numerator per denominator, got "
                         f"{len(numerators)} and {len(denominators)}")
    if any(d <= 0 for d in denominators):
        raise ValueError("denominators: must be positive")
    return median_ci([n / d for n, d in zip(numerators, denominators)], level)
