"""The per-request policy: the eligible action with the lowest expected handoff time.

`Planner(policy)` ranks every (b, c) the cost model predicts (`cost.choose`) and keeps only those
the quality gate's policy allows for this prompt length (outside the policy's range, only lossless
actions: BF16 and token-only). Each prediction is then corrected by how wrong predictions have
recently been on the decode worker (`corrections`: medians of measured/modelled time over recent
handoffs, which the decode side reports in its offer): the action's own median at prompts of
this length where it ran recently, else its kind's, following the seed: the final choice uses
measured latency. Between near-equal actions it keeps the previous choice (hysteresis).
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
    model_ms: float  # eq. 9's prediction of the chosen action, before the correction
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
            ranked.append((prediction,
                           prediction.total_ms * correction(corrections, prediction.action)))
        ranked.sort(key=lambda pair: (pair[1], pair[0].bytes))
        best, best_ms = ranked[0]
        key = inputs.prompt_len.bit_length()
        with self._lock:
            previous = self._last.get(key)
            kept = next(((p, ms) for p, ms in ranked if p.action == previous), None)
            if kept is not None and kept[1] <= best_ms * (1 + self.hysteresis):
                best, best_ms = kept
            self._last[key] = best.action
        return Decision(best.action, best_ms, best.total_ms, ranked)


def action_key(action: Action) -> str:
    """The key of one action's own ratio in an offer's corrections: `codec:cut`."""
    return f"{action.codec}:{action.cut}"


def correction(corrections: Mapping[str, float], action: Action) -> float:
    """The action's own measured/modelled ratio, else its kind's, else 1."""
    for key in (action_key(action), action.kind.value):
        factor = corrections.get(key, 0.0)
        if factor > 0:
            return factor
    return 1.0


class RecentRatios:
    """Measured over modelled handoff time over the last `window` handoffs: by action kind, and
    by action within each power of two of the prompt length."""

    def __init__(self, window: int = 16):
        def recent() -> collections.deque:
            return collections.deque(maxlen=window)

        self._by_kind: dict[str, collections.deque] = collections.defaultdict(recent)
        # prompt-length bucket -> action key -> ratios
        self._by_action: dict[int, dict[str, collections.deque]] = collections.defaultdict(
            lambda: collections.defaultdict(recent))
        self._lock = threading.Lock()

    def observe(self, action: Action, prompt_len: int, modelled_ms: float,
                measured_ms: float) -> None:
        if modelled_ms > 0 and measured_ms > 0:
            ratio = measured_ms / modelled_ms
            with self._lock:
                self._by_kind[action.kind.value].append(ratio)
                self._by_action[prompt_len.bit_length()][action_key(action)].append(ratio)

    def medians(self, prompt_len: int) -> dict[str, float]:
        """The corrections to offer for a prompt of `prompt_len` tokens."""
        with self._lock:
            series = {**self._by_kind, **self._by_action.get(prompt_len.bit_length(), {})}
            return {key: statistics.median(r) for key, r in series.items() if r}
