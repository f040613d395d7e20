"""The decode engine: one loop per decode worker that batches every stream's next token and
interleaves the worker's prefill-like work (suffix, token-only, recompute) in budgeted turns."""

from rekv_core.engine.budget import (ITL_BUDGET_FACTOR, ItlBudget, default_budget_ms,
                                     measure_costs)
from rekv_core.engine.layer_batcher import BatcherClosed, LayerBatcher
from rekv_core.engine.loop import (DecodeEngine, EngineClosed, EngineObserver, EngineState,
                                   Stream, engine_step, prepare_engine_thread)

__all__ = ["BatcherClosed", "DecodeEngine", "EngineClosed", "EngineObserver", "EngineState",
           "ITL_BUDGET_FACTOR", "ItlBudget", "LayerBatcher", "Stream", "default_budget_ms",
           "engine_step", "measure_costs", "prepare_engine_thread"]
