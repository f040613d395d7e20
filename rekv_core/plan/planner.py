"""The per-request policy: the eligible action with the lowest expected handoff time.

`Planner(policy)` ranks every (b, c) the cost model predicts (`cost.choose`) and keeps only those
the quality gate's policy allows for this prompt length (outside the policy's range, only lossless
actions: BF16 and token-only). Following the seed, the final choice uses measured latency: an
action that ran recently on the decode worker, at prompts of about this length over a link like
today's (`measured`, reported in the decode side's offer), is expected to take its own median
time, scaled to this prompt length by the cost model; any other action, the model's prediction
times the measured/modelled ratio of the nearest measured cut with the same codec, else its
kind's recent median of that ratio (`corrections`). Between near-equal actions it prefers a
measured one, then the previous choice (hysteresis). `RecentHandoffs` keeps both on the decode
side. An action whose measurements age out or whose link moved on is predicted again, so a change
of link that makes it attractive gets it tried.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from rekv_core.handoff import Action
from rekv_core.plan.cost import CostInputs, Prediction, choose, predict
from rekv_core.plan.policy import Policy


MIN_MEASURED = 3  # an action's own median counts from this many recent handoffs


@dataclass(frozen=True)
class Measured:
    """Recent handoffs of one action: median time, median prompt length, how many."""

    median_ms: float
    prompt_len: int
    count: int


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
    """`hysteresis`: among the actions expected within that fraction of the best one, prefer one
    whose expectation rests on its own recent measurements over one the model (with a neighbour's
    or its kind's correction) merely expects to be a little faster; then the action chosen last
    time for a request of similar length (the same power of two), so near-equal actions do not
    alternate with every estimate update; then the fastest. Trying an unmeasured action is worth
    it only for a gain beyond the margin. The link rate is not part of the key: a settling
    estimate must not reset it, and a real change of link moves the old choice past the margin
    anyway."""

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
               corrections: Mapping[str, float] | None = None,
               measured: Mapping[str, Measured] | None = None) -> Decision:
        ranked = []
        for prediction in choose(inputs, codecs):
            if not self.allowed(prediction.action, inputs.prompt_len):
                continue
            ranked.append((prediction, expected_ms(prediction, inputs, corrections, measured)))
        ranked.sort(key=lambda pair: (pair[1], pair[0].bytes))
        known = _usable(measured)
        margin = ranked[0][1] * (1 + self.hysteresis)
        key = inputs.prompt_len.bit_length()
        with self._lock:
            previous = self._last.get(key)
            best, best_ms = min((pair for pair in ranked if pair[1] <= margin), key=lambda pair: (
                action_key(pair[0].action) not in known, pair[0].action != previous, pair[1]))
            self._last[key] = best.action
        return Decision(best.action, best_ms, best.total_ms, ranked)


def action_key(action: Action) -> str:
    """The key of one action's own measurements in an offer: `codec:cut`."""
    return f"{action.codec}:{action.cut}"


def correction(corrections: Mapping[str, float], action: Action) -> float:
    """The action kind's measured/modelled ratio, else 1."""
    factor = corrections.get(action.kind.value, 0.0)
    return factor if factor > 0 else 1.0


def expected_ms(prediction: Prediction, inputs: CostInputs,
                corrections: Mapping[str, float] | None = None,
                measured: Mapping[str, Measured] | None = None) -> float:
    """What the action is expected to take, from the first of: its own recent median (scaled from
    its median prompt length to this one by the model); the model's time corrected by the
    measured/modelled ratio of the nearest cut measured with the same codec (neighbouring actions
    share the model's errors, such as an encoder slower than profiled); by its kind's ratio;
    the model's time alone."""
    action = prediction.action
    usable = _usable(measured)
    own = usable.get(action_key(action))
    if own is not None:
        then_ms = _modelled_at(action, inputs, own.prompt_len)
        return own.median_ms * prediction.total_ms / then_ms if then_ms > 0 else own.median_ms
    nearest = _nearest_measured(action, usable)
    if nearest is not None:
        neighbour, seen = nearest
        then_ms = _modelled_at(neighbour, inputs, seen.prompt_len)
        if then_ms > 0:
            return prediction.total_ms * seen.median_ms / then_ms
    return prediction.total_ms * correction(corrections or {}, action)


def _usable(measured: Mapping[str, Measured] | None) -> dict[str, Measured]:
    """The measurements an action's expectation may rest on: at least `MIN_MEASURED` handoffs."""
    return {key: m for key, m in (measured or {}).items()
            if m.count >= MIN_MEASURED and m.median_ms > 0}


def _modelled_at(action: Action, inputs: CostInputs, prompt_len: int) -> float:
    """The model's time for `action` at `prompt_len`, other inputs as now (γ linear in S)."""
    if prompt_len != inputs.prompt_len:
        inputs = dataclasses.replace(
            inputs, prompt_len=prompt_len,
            suffix_ms_per_layer=inputs.suffix_ms_per_layer * prompt_len / inputs.prompt_len)
    return predict(action, inputs).total_ms


def _nearest_measured(action: Action, usable: Mapping[str, Measured]
                      ) -> tuple[Action, Measured] | None:
    """The measured action with the same codec whose cut is nearest (token-only has none)."""
    if action.cut == 0:
        return None
    best = None
    for key, seen in usable.items():
        codec, _, cut = key.partition(":")
        if codec != action.codec or not cut.isdigit() or int(cut) == 0:
            continue
        rank = (abs(int(cut) - action.cut), -seen.count)
        if best is None or rank < best[0]:
            best = (rank, Action(codec, int(cut), action.num_layers), seen)
    return None if best is None else (best[1], best[2])


@dataclass(frozen=True)
class _Handoff:
    prompt_len: int
    measured_ms: float
    over_model: float  # measured / modelled (0: no model)
    link_gbps: float
    at: float  # clock seconds


class RecentHandoffs:
    """The decode side's memory of its recent handoffs, for its offers.

    Only handoffs younger than `max_age_s`, over a link within a factor `link_tolerance` of the
    current estimate, speak for a new request. By action kind: the median of measured over
    modelled time of the last `window` such handoffs. By action, within each power of two of the
    prompt length: the median time of its last `window` such handoffs."""

    def __init__(self, window: int = 16, max_age_s: float = 600.0, link_tolerance: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        def recent() -> collections.deque:
            return collections.deque(maxlen=window)

        self.max_age_s = max_age_s
        self.link_tolerance = link_tolerance
        self._clock = clock
        self._by_kind: dict[str, collections.deque] = collections.defaultdict(recent)
        # prompt-length bucket -> action key -> handoffs
        self._by_action: dict[int, dict[str, collections.deque]] = collections.defaultdict(
            lambda: collections.defaultdict(recent))
        self._lock = threading.Lock()

    def observe(self, action: Action, prompt_len: int, modelled_ms: float, measured_ms: float,
                link_gbps: float) -> None:
        if measured_ms <= 0 or link_gbps <= 0:
            return
        handoff = _Handoff(prompt_len, measured_ms,
                           measured_ms / modelled_ms if modelled_ms > 0 else 0.0, link_gbps,
                           self._clock())
        with self._lock:
            if handoff.over_model > 0:
                self._by_kind[action.kind.value].append(handoff)
            self._by_action[prompt_len.bit_length()][action_key(action)].append(handoff)

    def _alike(self, handoffs: Iterable[_Handoff], link_gbps: float) -> list[_Handoff]:
        oldest = self._clock() - self.max_age_s
        return [h for h in handoffs if h.at >= oldest and max(
            h.link_gbps / link_gbps, link_gbps / h.link_gbps) <= self.link_tolerance]

    def corrections(self, link_gbps: float) -> dict[str, float]:
        """Median measured/modelled time by action kind."""
        with self._lock:
            series = {kind: self._alike(h, link_gbps) for kind, h in self._by_kind.items()}
        return {kind: statistics.median(h.over_model for h in alike)
                for kind, alike in series.items() if alike}

    def measured(self, prompt_len: int, link_gbps: float) -> dict[str, Measured]:
        """Each action's recent handoffs that speak for a prompt of `prompt_len` tokens over a
        link of `link_gbps`."""
        with self._lock:
            series = {key: self._alike(h, link_gbps) for key, h in
                      self._by_action.get(prompt_len.bit_length(), {}).items()}
        return {key: Measured(statistics.median(h.measured_ms for h in alike),
                              statistics.median_low(h.prompt_len for h in alike), len(alike))
                for key, alike in series.items() if alike}
