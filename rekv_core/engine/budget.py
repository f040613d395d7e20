"""The inter-token latency budget, and how much prefill-like work fits into it.

Between two decode steps the engine grants one turn of prefill-like work (`model.turns`). A
running stream waits, between two of its tokens, for one step of the batch and one such turn, so
a turn may compute for at most `budget_ms − step_ms(B)`: `ItlBudget.allowance(B)` is that time in
token-layers (rows × layers) at the measured cost of one token-layer, never less than nothing
(the turn then runs its smallest piece, one block of rows through one layer: with a batch whose
step alone takes the budget, the budget cannot be kept, and prefill work still progresses).

A token-layer costs more the more keys its row attends to: `cost_ms(context) = scale × (base +
per_key × context)`, `context` the keys a piece's rows attend to on average; a turn asks with
the context of the rows it would take next, and plans to use `SAFETY` of the spare time. The costs
are learned as the engine runs: `observe_step(B, ms)` updates a moving average per batch size
(`EWMA`; a size not yet seen is interpolated between the sizes seen, extrapolated from the
largest two beyond them), and `observe_piece(token_layers, ms, context)` the `scale` (observed
over modelled). `measure_costs(model)` gives the starting points, measured while the worker is
idle (before it serves): the median of a few single-stream steps over a short cache, and of a
piece of one block of rows through two layers at two positions (base and per_key from the two). The default budget (`default_budget_ms`) is `ITL_BUDGET_FACTOR` × that
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
SAFETY = 0.85  # of the spare time a turn's allowance plans to use
MEASURE_REPEATS = 3
MEASURE_CONTEXT = 64  # positions in the cache the idle step is measured over
MEASURE_LAYERS = 2  # layers of the measured pieces
MEASURE_FAR = 3  # the second piece's rows start this many blocks in


def default_budget_ms(idle_step_ms: float) -> float:
    return ITL_BUDGET_FACTOR * idle_step_ms


class ItlBudget:
    def __init__(self, budget_ms: float, idle_step_ms: float, token_layer_ms: float,
                 per_key_ms: float = 0.0):
        for name, value in (("budget_ms", budget_ms), ("idle_step_ms", idle_step_ms),
                            ("token_layer_ms", token_layer_ms)):
            if not value > 0:
                raise ValueError(f"{name}: must be positive, got {value}")
        if per_key_ms < 0:
            raise ValueError(f"per_key_ms: must be >= 0, got {per_key_ms}")
        self.budget_ms = budget_ms
        self._base_ms, self._per_key_ms = token_layer_ms, per_key_ms
        self._scale = 1.0  # observed over modelled piece cost, learned
        self._steps: dict[int, float] = {1: idle_step_ms}

    @property
    def token_layer_ms(self) -> float:
        """The learned cost of one token-layer attending to no earlier keys."""
        return self._scale * self._base_ms

    def cost_ms(self, context: int = 0) -> float:
        """One token-layer whose row attends to `context` keys on average."""
        return self._scale * (self._base_ms + self._per_key_ms * max(0, context))

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

    def allowance(self, batch: int, context: int = 0) -> int:
        """Token-layers one turn may compute beside a batch of `batch` streams, its rows
        attending to `context` keys on average (`SAFETY` of the spare time: a piece's cost is
        a model's)."""
        spare = self.budget_ms - self.step_ms(batch)
        return max(0, int(SAFETY * spare / self.cost_ms(context)))

    def observe_step(self, batch: int, ms: float) -> None:
        old = self._steps.get(batch)
        self._steps[batch] = ms if old is None else (1 - EWMA) * old + EWMA * ms

    def observe_piece(self, token_layers: int, ms: float, context: int = 0) -> None:
        if token_layers > 0 and ms > 0:
            modelled = token_layers * (self._base_ms + self._per_key_ms * max(0, context))
            self._scale = (1 - EWMA) * self._scale + EWMA * ms / modelled


def _median_ms(run, repeats: int = MEASURE_REPEATS) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def measure_costs(model: Model, step: Callable | None = None) -> tuple[float, float, float]:
    """(idle single-stream step ms, ms per token-layer attending to no keys, ms more per key) on
    this worker now; `step`: the engine's batched step (`batched_decode_step` by default)."""
    from rekv_core.model.batched import batched_decode_step
    from rekv_core.model.executor import run_layers_chunk

    batched = step or batched_decode_step
    shape = model.shape
    layers = min(MEASURE_LAYERS, shape.num_layers)
    far = MEASURE_FAR * EXEC_BLOCK
    def empty(capacity: int) -> KVCache:
        return KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, capacity,
                       model.dtype, model.device)

    cache, step_cache = empty(far + EXEC_BLOCK), empty(MEASURE_CONTEXT + 1)

    def sync() -> None:
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)

    def one_step() -> None:
        step_cache.length = MEASURE_CONTEXT
        batched(model, [0], [step_cache])
        sync()

    rows = torch.zeros(EXEC_BLOCK, shape.hidden_size, dtype=model.dtype, device=model.device)

    def piece(pos: int):
        def run() -> None:
            run_layers_chunk(model, rows, 0, pos, cache, layers)
            sync()
        return run

    one_step()  # warm-up
    step_ms = _median_ms(one_step)
    per_token_layer = []
    for pos in (0, far):
        piece(pos)()
        per_token_layer.append(_median_ms(piece(pos)) / (EXEC_BLOCK * layers))
    # mean keys attended: pos + EXEC_BLOCK / 2 for a block of rows at pos
    per_key = max(0.0, (per_token_layer[1] - per_token_layer[0]) / far)
    base = max(per_token_layer[0] - per_key * EXEC_BLOCK / 2, per_token_layer[0] / 4)
    return step_ms, base, per_key
