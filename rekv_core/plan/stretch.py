"""How much longer decode-side compute takes when it is interleaved with a running batch.

A decode engine grants prefill-like work (a suffix, a token-only prefill) turns between the steps
of its batch, each sized to what the ITL budget leaves beside a step (`rekv_core.engine`): the
planner stretches the decode side's compute cost by that factor (`connector.prefill`).
"""

from __future__ import annotations

MAX_STRETCH = 10.0  # a step of the batch alone at or past the budget


def interleaved_stretch(running: int, budget_ms: float, step_ms: float) -> float:
    """Wall time over compute time of decode-side compute interleaved with a running batch:
    T / (T − s_B) for B > 0 streams, a budget T > 0 and a step s_B; 1 otherwise."""
    if running <= 0 or budget_ms <= 0:
        return 1.0
    spare = budget_ms - step_ms
    if spare <= budget_ms / MAX_STRETCH:
        return MAX_STRETCH
    return budget_ms / spare
