"""The per-request policy: the eligible action with the lowest expected handoff time.

`Planner(policy).decide(inputs, codecs, evidence)` ranks every (b, c) the cost model predicts
(`cost.choose`) and keeps only those the quality gate's policy allows for this prompt length
(outside the policy's range, only lossless actions: BF16 and token-only). Following the seed, the
final choice uses measured latency (`Evidence`, from the decode side's `RecentHandoffs`): an action
that ran recently on the decode worker, at prompts of about this length over a link like today's,
is expected to take its own median time, scaled to this prompt length by the cost model; any other
action, the model's prediction times the measured/modelled ratio of the nearest measured cut with
the same codec, else its kind's recent median of that ratio. Between near-equal actions it prefers
a measured one, then the previous choice (hysteresis). With `forced`, the decision is that action
with what the planner expects of it, beside the same ranking.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from rekv_core.codecs import BASELINE_CODEC
from rekv_core.handoff import Action, ActionKind
from rekv_core.plan.cost import CostInputs, Prediction, choose, predict
from rekv_core.plan.policy import Policy
from rekv_core.plan.recent import Measured, length_bucket

MIN_MEASURED = 3  # an action's own median counts from this many recent handoffs
HYSTERESIS = 0.1  # actions expected within this fraction of the best count as near-equal


@dataclass(frozen=True)
class Evidence:
    """What the decode side's recent handoffs say, over a link like today's."""

    over_model: Mapping[ActionKind, float] = field(default_factory=dict)  # by kind
    measured: Mapping[Action, Measured] = field(default_factory=dict)  # this length's bucket


class Ranked(NamedTuple):
    prediction: Prediction  # eq. 9's
    expected_ms: float  # what the planner expects, corrected by the evidence


@dataclass(frozen=True)
class Decision:
    action: Action
    predicted_ms: float  # expected, corrected by the evidence
    model_ms: float  # eq. 9's prediction of the chosen action, before the correction
    candidates: list[Ranked]  # every allowed action, best first
    inputs: CostInputs  # what the decision was made from
    forced: bool = False

    def as_dict(self) -> dict:
        return {"chosen": {"action": self.action.kind.value, "codec": self.action.codec,
                           "cut": self.action.cut, "predicted_ms": self.predicted_ms},
                "candidates": [{**p.as_dict(), "model_ms": p.total_ms, "predicted_ms": ms}
                               for p, ms in self.candidates]}


class Planner:
    """`hysteresis`: among the actions expected within that fraction of the best one, prefer one
    whose expectation rests on its own recent measurements over one the model (with a neighbour's
    or its kind's correction) merely expects to be a little faster; then the action chosen last
    time for a request of similar length (the same power of two), so near-equal actions do not
    alternate with every estimate update; then the fastest. Trying an unmeasured action is worth
    it only for a gain beyond the margin. The link rate is not part of the key: a settling
    estimate must not reset it, and a real change of link moves the old choice past the margin
    anyway."""

    def __init__(self, policy: Policy | None = None, hysteresis: float = HYSTERESIS):
        self.policy = policy
        self.hysteresis = hysteresis
        self._last: dict[int, Action] = {}
        self._lock = threading.Lock()

    def allowed(self, action: Action, prompt_len: int) -> bool:
        if action.lossless:
            return True
        if self.policy is None or not self.policy.covers(prompt_len):
            return False
        return self.policy.eligible(action)

    def decide(self, inputs: CostInputs, codecs: Iterable[str], evidence: Evidence = Evidence(),
               forced: Action | None = None) -> Decision:
        ranked = [Ranked(p, expected_ms(p, inputs, evidence)) for p in choose(inputs, codecs)
                  if self.allowed(p.action, inputs.prompt_len)]
        ranked.sort(key=lambda r: (_cost(r), r.prediction.bytes))
        known = _usable(evidence.measured)
        margin = _cost(ranked[0]) * (1 + self.hysteresis)
        key = length_bucket(inputs.prompt_len)
        with self._lock:
            previous = self._last.get(key)
            best = min((r for r in ranked if _cost(r) <= margin), key=lambda r: (
                r.prediction.action not in known, r.prediction.action != previous, _cost(r)))
            self._last[key] = best.prediction.action
        if forced is None:
            return Decision(best.prediction.action, best.expected_ms, best.prediction.total_ms,
                            ranked, inputs)
        prediction = predict(forced, inputs)
        return Decision(forced, expected_ms(prediction, inputs, evidence), prediction.total_ms,
                        ranked, inputs, forced=True)


def _cost(ranked: Ranked) -> float:
    """What the choice minimizes: the expected time plus the wait it puts on queued requests."""
    return ranked.expected_ms + ranked.prediction.load_ms


def common_codecs(mine: Iterable[str], theirs: Iterable[str]) -> list[str]:
    """The prefix codecs both workers take, in this worker's order; the baseline when none."""
    theirs = set(theirs)
    return [c for c in mine if c in theirs] or [BASELINE_CODEC]


def expected_ms(prediction: Prediction, inputs: CostInputs, evidence: Evidence = Evidence()
                ) -> float:
    """What the action is expected to take, from the first of: its own recent median (scaled from
    its median prompt length to this one by the model); the model's time corrected by the
    measured/modelled ratio of the nearest cut measured with the same codec (neighbouring actions
    share the model's errors, such as an encoder slower than profiled); by its kind's ratio;
    the model's time alone."""
    action = prediction.action
    usable = _usable(evidence.measured)
    own = usable.get(action)
    if own is not None:
        then_ms = _modelled_at(action, inputs, own.prompt_len)
        return own.median_ms * prediction.total_ms / then_ms if then_ms > 0 else own.median_ms
    nearest = _nearest_measured(action, usable)
    if nearest is not None:
        neighbour, seen = nearest
        then_ms = _modelled_at(neighbour, inputs, seen.prompt_len)
        if then_ms > 0:
            return prediction.total_ms * seen.median_ms / then_ms
    factor = evidence.over_model.get(action.kind, 0.0)
    return prediction.total_ms * (factor if factor > 0 else 1.0)


def _usable(measured: Mapping[Action, Measured]) -> dict[Action, Measured]:
    """The measurements an action's expectation may rest on: at least `MIN_MEASURED` handoffs."""
    return {action: m for action, m in measured.items()
            if m.count >= MIN_MEASURED and m.median_ms > 0}


def _modelled_at(action: Action, inputs: CostInputs, prompt_len: int) -> float:
    """The model's time for `action` at `prompt_len`, other inputs as now (γ linear in S)."""
    if prompt_len != inputs.prompt_len:
        inputs = dataclasses.replace(
            inputs, prompt_len=prompt_len,
            suffix_ms_per_layer=inputs.suffix_ms_per_layer * prompt_len / inputs.prompt_len)
    return predict(action, inputs).total_ms


def _nearest_measured(action: Action, usable: Mapping[Action, Measured]
                      ) -> tuple[Action, Measured] | None:
    """The measured action with the same codec whose cut is nearest (token-only has none)."""
    if action.cut == 0:
        return None
    best = None
    for other, seen in usable.items():
        if other.codec != action.codec or other.cut == 0:
            continue
        rank = (abs(other.cut - action.cut), -seen.count)
        if best is None or rank < best[0]:
            best = (rank, other, seen)
    return None if best is None else (best[1], best[2])
