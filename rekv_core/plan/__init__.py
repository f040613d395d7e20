"""Choosing the handoff action: the cost model, the measurements that feed it, the choice."""

from rekv_core.plan.cost import CostInputs, Prediction, candidate_actions, choose, predict

__all__ = ["CostInputs", "Prediction", "candidate_actions", "choose", "predict"]
