"""The per-request policy: the eligible action with the lowest expected handoff time.

`Planner(policy)` ranks every (b, c) the cost model predicts (`cost.choose`) and keeps only those
the quality gate's policy allows for this prompt length (outside the policy's range, only lossless
actions: BF16 and token-only). Each prediction is then corrected by how wrong predictions of that
action kind have recently been on the decode worker (`corrections`: median of measured/predicted
over recent handoffs, which the decode side reports in its offer), following the seed: the final
choice uses measured latency. Between near-equal actions it keeps the previous choice (hysteresis).
`RecentRatios` keeps those medians on the decode side.
"""

from __future__ import annotations

import collections
import statistics
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rekv_core.handoff import Action
from rekv_core.plan.cost import CostInputs, Prediction, choose
from rekv_core.plan.policy import Policy


@dataclass(frozen=True)
class Decision:
    action: Action
    predicted_ms: float  # corrected
    candidates: list[tuple[Prediction, float]]  # (model prediction, corrected ms), best first

    def as_dict(self) -> dict:
        return {"chosen": {"action": self.action.kind.value, "codec": self.action.codec,
                           "cut": self.action.cut, "predicted_ms": self.predicted_ms},
                "candidates": [{**p.as_dict(), "model_ms": p.total_ms, "predicted_ms": ms}
                               for p, ms in self.candidates]}


class Planner:
    """`hysteresis`: keep the action chosen last time for a request of similar length (the same
    power of two) while its prediction is within that fraction of the best one, so near-equal
    actions do not alternate with every estimate update. The link rate is not part of the key: a
    settling estimate must not reset it, and a real change of link moves the prediction of the
    old choice past the margin anyway."""

    def __init__(self, policy: Policy | None = None, hysteresis: float = 0.1):
        self.policy = policy
        self.hysteresis = hysteresis
        self._last: dict[int, Action] = {}
        self._lock = threading.Lock()

    def allowed(self, action: Action, prompt_len: int) -> bool:
        if action.cut == 0 or action.codec == "bf16":
            return True
        if self.policy is None or not self.policy.covers(prompt_len):
            return False
        return self.policy.eligible(action)

    def decide(self, inputs: CostInputs, codecs: Iterable[str],
               corrections: Mapping[str, float] | None = None) -> Decision:
        corrections = corrections or {}
        ranked = []
        for prediction in choose(inputs, codecs):
            if not self.allowed(prediction.action, inputs.prompt_len):
                continue
            factor = corrections.get(prediction.action.kind.value, 1.0)
            ranked.append((prediction, prediction.total_ms * (factor if factor > 0 else 1.0)))
        ranked.sort(key=lambda pair: (pair[1], pair[0].bytes))
        best, best_ms = ranked[0]
        key = inputs.prompt_len.bit_length()
        with self._lock:
            previous = self._last.get(key)
            kept = next(((p, ms) for p, ms in ranked if p.action == previous), None)
            if kept is not None and kept[1] <= best_ms * (1 + self.hysteresis):
                best, best_ms = kept
            self._last[key] = best.action
        return Decision(best.action, best_ms, ranked)


class RecentRatios:
    """Measured over predicted handoff time, by action kind, over the last `window` handoffs."""

    def __init__(self, window: int = 16):
        self._ratios: dict[str, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=window))
        self._lock = threading.Lock()

    def observe(self, kind: str, predicted_ms: float, measured_ms: float) -> None:
        if predicted_ms > 0 and measured_ms > 0:
            with self._lock:
                self._ratios[kind].append(measured_ms / predicted_ms)

    def medians(self) -> dict[str, float]:
        with self._lock:
            return {kind: statistics.median(r) for kind, r in self._ratios.items() if r}
