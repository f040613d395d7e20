"""Wall-clock timing of work that may run on a CUDA device.

`median_seconds(fn, repeats, device, warmups)` runs `fn` `warmups` times untimed, then `repeats`
times between device synchronizations, and returns the median in seconds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], repeats: int, device: torch.device,
                   warmups: int = 1) -> float:
    for _ in range(warmups):
        fn()
    samples = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
