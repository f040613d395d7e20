"""The inter-token latency budget, and how much prefill-like work fits into it.

Between two decode steps the engine grants one turn of prefill-like work (`model.turns`). A
running stream waits, between two of its tokens, for one step of the batch and one such turn, so
a turn may compute for at most `budget_ms − step_ms(B)`: `ItlBudget.allowance(B)` is that time in
token-layers (rows × layers) at the measured cost of one token-layer, never less than nothing
(the turn then runs its smallest piece, one block of rows through one layer: with a batch whose
step alone takes the budget, the budget cannot be kept, and prefill work still progresses).

The costs are learned as the engine runs: `observe_step(B, ms)` and `observe_piece(token_layers,
ms)` update moving averages (`EWMA`); a batch size not yet seen is estimated by linear
interpolation between the sizes seen (extrapolated from the largest two beyond them).
`measure_costs(model)` gives the starting points: the median of a few single-stream steps over a
short cache, and of a piece of one block of rows through two layers, measured while the worker is
idle (before it serves). The default budget (`default_budget_ms`) is `ITL_BUDGET_FACTOR` × that
idle single-stream step: a stream may slow to a third of its idle rate while the worker takes in a
new request, and a busier batch leaves correspondingly less room for the chunks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from rekv_core.model.blocks import EXEC_BLOCK
from rekv_core.model.cache import KVCache
from rekv_core.model.layer import Model

ITL_BUDGET_FACTOR = 3.0
EWMA = 0.2  # weight of the newest observation
MEASURE_REPEATS = 3
MEASURE_CONTEXT = 64  # positions in the cache the idle step is measured over
MEASURE_LAYERS = 2  # layers of the measured piece


def default_budget_ms(idle_step_ms: float) -> float:
    return ITL_BUDGET_FACTOR * idle_step_ms


class ItlBudget:
    def __init__(self, budget_ms: float, idle_step_ms: float, token_layer_ms: float):
        for name, value in (("budget_ms", budget_ms), ("idle_step_ms", idle_step_ms),
                            ("token_layer_ms", token_layer_ms)):
            if not value > 0:
                raise ValueError(f"{name}: must be positive, got {value}")
        self.budget_ms = budget_ms
        self.token_layer_ms = token_layer_ms
        self._steps: dict[int, float] = {1: idle_step_ms}

    def step_ms(self, batch: int) -> float:
        """The expected step of a batch of `batch` streams (0: none runs)."""
        if batch <= 0:
            return 0.0
        if batch in self._steps:
            return self._steps[batch]
        sizes = sorted(self._steps)
        below = [b for b in sizes if b < batch]
        above = [b for b in sizes if b > batch]
        if below and above:
            lo, hi = below[-1], above[0]
        elif len(sizes) >= 2:
            lo, hi = (sizes[-2], sizes[-1]) if below else (sizes[0], sizes[1])
        else:  # one size known: a step grows at most in proportion to its batch
            return self._steps[sizes[0]] * max(1.0, batch / sizes[0])
        slope = (self._steps[hi] - self._steps[lo]) / (hi - lo)
        return max(self._steps[lo] + slope * (batch - lo), min(self._steps.values()))

    def allowance(self, batch: int) -> int:
        """Token-layers one turn may compute beside a batch of `batch` streams."""
        spare = self.budget_ms - self.step_ms(batch)
        return max(0, int(spare / self.token_layer_ms))

    def observe_step(self, batch: int, ms: float) -> None:
        old = self._steps.get(batch)
        self._steps[batch] = ms if old is None else (1 - EWMA) * old + EWMA * ms

    def observe_piece(self, token_layers: int, ms: float) -> None:
        if token_layers > 0 and ms > 0:
            cost = ms / token_layers
            self.token_layer_ms = (1 - EWMA) * self.token_layer_ms + EWMA * cost


def _median_ms(run, repeats: int = MEASURE_REPEATS) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def measure_costs(model: Model, step: Callable | None = None) -> tuple[float, float]:
    """(idle single-stream step ms, ms per token-layer of prefill-like work) on this worker now;
    `step`: the engine's batched step (`batched_decode_step` by default)."""
    from rekv_core.model.batched import batched_decode_step
    from rekv_core.model.executor import run_layers_chunk

    batched = step or batched_decode_step

    shape = model.shape
    layers = min(MEASURE_LAYERS, shape.num_layers)
    cache = KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                    max(EXEC_BLOCK, MEASURE_CONTEXT + MEASURE_REPEATS + 1), model.dtype,
                    model.device)

    def one_step() -> None:
        cache.length = MEASURE_CONTEXT
        batched(model, [0], [cache])
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)

    rows = torch.zeros(EXEC_BLOCK, shape.hidden_size, dtype=model.dtype, device=model.device)

    def chunk() -> None:
        run_layers_chunk(model, rows, 0, 0, cache, layers)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)

    one_step()  # warm-up
    step_ms = _median_ms(one_step)
    chunk()
    piece_ms = _median_ms(chunk)
    return step_ms, piece_ms / (EXEC_BLOCK * layers)
