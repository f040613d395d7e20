"""The per-request policy: the eligible action with the lowest expected handoff time.

`Planner(policy).decide(inputs, codecs, evidence, quality=...)` ranks every (b, c) the cost model
predicts (`cost.choose`) and keeps only those the request's quality setting allows (`Quality`:
under `lossless`, only actions that reproduce the reference bit for bit, whatever the link) and
the quality gate's policy allows for this prompt length (outside the policy's range, only lossless
actions: BF16, SplitZip and token-only). It returns a `Decision`
whose `plan` is the `HandoffPlan` the sender executes: the action, its codec as the model deploys
it (the policy's), the delivery in the order the prediction took, the boundary's codebook and the
expected time. Following the seed, the
final choice uses measured latency (`Evidence`, from the decode side's `RecentHandoffs`): an action
that ran recently on the decode worker, at prompts of about this length over a link like today's,
is expected to take its own median time, scaled to this prompt length by the cost model; any other
action, the model's prediction times the measured/modelled ratio of the nearest measured cut with
the same codec, else its kind's recent median of that ratio; an action's measurements count only
for the order they were sent in (layer or token order, `cost`'s `order`). Between near-equal actions
it prefers
a measured one, then the previous choice (hysteresis). With `forced`, the decision is that action
with what the planner expects of it, beside the same ranking.

Cold, it does not trust what it has not measured:

- while the link is unmeasured (`CostInputs.link_measured` false: the decode side has no link sample
  and the rate in `inputs` is only a prior), it takes the action with the least worst-case regret
  (its expected time over the best action's) across plausible link rates (`UNMEASURED_LINK_RANGE`,
  from a thousandth of the prior to ten times it); among actions near that least regret, one whose
  bytes land back-to-back before the decode side starts computing, enough to time the link
  (`samples_link`), so the next request is planned on a measured link. The regret is the model's
  (with the evidence's corrections), so it bounds the first request's loss only as well as the
  profile describes this machine;
- every `explore_every`-th decision for a prompt-length bucket, it tries the best candidate whose
  expectation does not rest on its own recent measurements and which the model alone expects
  within `EXPLORE_FACTOR` of the chosen action's expected time: an action rejected on a
  neighbour's or its kind's correction gets measured again. Only while both workers are idle
  (no queue on either, as the inputs say): under load the model's error is the queue's, a trial
  would measure the load more than the action, and its cost falls on every request behind it;
  an exploration that falls due under load waits for the bucket's next idle decision.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from rekv_core.codecs import BASELINE_CODEC, Codec, get_codec
from rekv_core.handoff import Action, Delivery, HandoffPlan, Order, wire_bytes
from rekv_core.model.blocks import chunk_bounds
from rekv_core.plan.cost import CostInputs, Prediction, choose, predict
from rekv_core.plan.evidence import Evidence, Measured
from rekv_core.plan.policy import Policy
from rekv_core.plan.quality import DEFAULT_QUALITY, Quality
from rekv_core.plan.recent import length_bucket
from rekv_core.units import BF16_BYTES

MIN_MEASURED = 3  # an action's own median counts from this many recent handoffs
HYSTERESIS = 0.1  # actions expected within this fraction of the best count as near-equal
# A handoff's back-to-back runs must carry this much to time the link: smaller runs say more about
# per-message latency than about the rate.
LINK_SAMPLE_BYTES = 256 << 10
# Unmeasured link: the plausible rates span these factors of the prior (a prior is optimistic, and
# the prefill side's stand-in, its own send throughput, counts encoding too), at
# `UNMEASURED_LINK_STEPS` rates per factor of ten. An action that samples the link is preferred
# among those whose worst-case regret exceeds the least by at most `SAMPLE_SHARE` of what the least
# loses (least − 1, the most a measured link can win back on each later request).
UNMEASURED_LINK_RANGE = (1e-3, 10.0)
UNMEASURED_LINK_STEPS = 3
SAMPLE_SHARE = 0.5
# Exploration: every this many decisions per length bucket (0: never); within this factor.
EXPLORE_EVERY = 16
EXPLORE_FACTOR = 1.5


def usable(evidence: Evidence, pipelined: bool) -> dict[Action, Measured]:
    """The measurements in this order an action's expectation may rest on: at least
    `MIN_MEASURED` handoffs."""
    measured = evidence.measured_pipelined if pipelined else evidence.measured
    return {action: m for action, m in measured.items()
            if m.count >= MIN_MEASURED and m.median_ms > 0}


class Ranked(NamedTuple):
    prediction: Prediction  # eq. 9's
    expected_ms: float  # what the planner expects, corrected by the evidence


class Rule(str, enum.Enum):
    """Why the decision took its action."""

    BEST = "best"  # the least expected cost (with hysteresis)
    UNMEASURED_LINK = "unmeasured_link"  # the least worst-case regret over plausible link rates
    EXPLORE = "explore"  # a near candidate not measured recently, tried on purpose
    FORCED = "forced"


@dataclass(frozen=True)
class Decision:
    plan: HandoffPlan  # what to send; its `predicted_ms` is the expected time, evidence included
    model_ms: float  # eq. 9's prediction of the chosen action, before the correction
    candidates: list[Ranked]  # every allowed action, best first
    inputs: CostInputs  # what the decision was made from
    rule: Rule = Rule.BEST

    @property
    def action(self) -> Action:
        return self.plan.action

    @property
    def predicted_ms(self) -> float:
        return self.plan.predicted_ms

    @property
    def pipelined(self) -> bool:
        return self.plan.pipelined

    @property
    def forced(self) -> bool:
        return self.rule is Rule.FORCED

    def as_dict(self) -> dict:
        return {"chosen": {"action": self.action.kind.value, "codec": self.action.codec,
                           "cut": self.action.cut, "split": self.action.split,
                           "layer_split": self.action.layer_split,
                           "predicted_ms": self.predicted_ms,
                           "pipelined": self.pipelined},
                "rule": self.rule.value,
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
    anyway. `explore_every`: every that many decisions per length bucket on a measured link, an
    exploring one (module doc; 0: never). Forced decisions neither count nor move the memory."""

    def __init__(self, policy: Policy | None = None, hysteresis: float = HYSTERESIS,
                 explore_every: int = EXPLORE_EVERY):
        if explore_every < 0:
            raise ValueError(f"explore_every: must be >= 0, got {explore_every}")
        self.policy = policy
        self.hysteresis = hysteresis
        self.explore_every = explore_every
        self._last: dict[int, Action] = {}
        self._decisions: dict[int, int] = {}  # by length bucket, on a measured link
        self._explore_due: set[int] = set()  # buckets whose exploration waits for an idle moment
        self._lock = threading.Lock()

    def allowed(self, action: Action, prompt_len: int, quality: Quality = DEFAULT_QUALITY
                ) -> bool:
        if action.lossless:
            return True
        if not quality.allows(action):
            return False
        if self.policy is None or not self.policy.covers(prompt_len):
            return False
        return self.policy.eligible(action)

    def deployed(self, codec: str) -> Codec:
        """The codec `codec` as this model deploys it (the policy's; ValueError naming it when the
        gate's findings rule it out), else the registry's."""
        return self.policy.codec(codec) if self.policy is not None else get_codec(codec)

    def decide(self, inputs: CostInputs, codecs: Iterable[str], evidence: Evidence = Evidence(),
               forced: Action | None = None, quality: Quality = DEFAULT_QUALITY) -> Decision:
        """The plan for this request: `forced`'s, evaluated as any other, else the choice among
        the actions `quality` allows (a forced action is checked against it by the caller)."""
        codecs = list(codecs)
        ranked = [Ranked(p, expected_ms(p, inputs, evidence)) for p in choose(inputs, codecs)
                  if self.allowed(p.action, inputs.prompt_len, quality)]
        ranked.sort(key=lambda r: (_cost(r), r.prediction.bytes))
        if forced is not None:
            prediction = predict(forced, inputs)
            chosen, rule = Ranked(prediction, expected_ms(prediction, inputs, evidence)), \
                Rule.FORCED
        elif inputs.link_measured:
            idle = inputs.prefill_queue == 0 and inputs.decode_queue == 0
            chosen, rule = self._best(ranked, evidence, length_bucket(inputs.prompt_len), idle)
        else:
            chosen, rule = safe_choice(ranked, inputs, codecs, evidence), Rule.UNMEASURED_LINK
            with self._lock:
                self._last[length_bucket(inputs.prompt_len)] = chosen.prediction.action
        return Decision(self._plan(chosen, inputs), chosen.prediction.total_ms, ranked, inputs,
                        rule)

    def _plan(self, chosen: Ranked, inputs: CostInputs) -> HandoffPlan:
        action = chosen.prediction.action
        delivery = Delivery(inputs.streamed, inputs.chunk_tokens,
                            Order.TOKENS if chosen.prediction.pipelined else Order.LAYERS)
        codebook = self.policy.splitzip_codebook("boundary") if self.policy else None
        return HandoffPlan(action, inputs.prompt_len, inputs.shape, delivery,
                           self.deployed(action.codec) if action.cut else None,
                           tuple(codebook) if codebook else None, chosen.expected_ms)

    def _best(self, ranked: list[Ranked], evidence: Evidence, key: int, idle: bool
              ) -> tuple[Ranked, Rule]:
        known = _Known(evidence)
        margin = _cost(ranked[0]) * (1 + self.hysteresis)
        with self._lock:
            previous = self._last.get(key)
            best = min((r for r in ranked if _cost(r) <= margin), key=lambda r: (
                r not in known, r.prediction.action != previous, _cost(r)))
            count = self._decisions[key] = self._decisions.get(key, 0) + 1
            if self.explore_every and count % self.explore_every == 0:
                self._explore_due.add(key)
            if idle and key in self._explore_due:
                self._explore_due.discard(key)
                trial = _exploration(ranked, known, best)
                if trial is not None:
                    return trial, Rule.EXPLORE
            self._last[key] = best.prediction.action
        return best, Rule.BEST


class _Known:
    """`ranked in known`: its action has recent measurements in its predicted order."""

    def __init__(self, evidence: Evidence):
        self._by_order = {False: usable(evidence, False), True: usable(evidence, True)}

    def __contains__(self, ranked: Ranked) -> bool:
        return ranked.prediction.action in self._by_order[ranked.prediction.pipelined]


def _exploration(ranked: list[Ranked], known: _Known, best: Ranked) -> Ranked | None:
    """The best candidate other than `best` not measured recently that the model alone expects
    within `EXPLORE_FACTOR` of `best`'s expected cost, if any."""
    bound = EXPLORE_FACTOR * _cost(best)
    return next((r for r in ranked if r not in known
                 and r.prediction.action != best.prediction.action
                 and r.prediction.total_ms + r.prediction.load_ms <= bound), None)


def unmeasured_link_rates(prior_gbps: float) -> list[float]:
    """The plausible link rates while the link is unmeasured: `UNMEASURED_LINK_RANGE` times the
    prior, log-spaced."""
    low, high = UNMEASURED_LINK_RANGE
    steps = max(1, round(math.log10(high / low) * UNMEASURED_LINK_STEPS))
    return [prior_gbps * low * (high / low) ** (i / steps) for i in range(steps + 1)]


def worst_regret(ranked: list[Ranked], inputs: CostInputs, codecs: Iterable[str],
                 evidence: Evidence = Evidence()) -> dict[Action, float]:
    """Each ranked action's largest expected cost over the best one's, across
    `unmeasured_link_rates(inputs.link_gbps)`."""
    worst = {r.prediction.action: 1.0 for r in ranked}
    codecs = list(codecs)
    for gbps in unmeasured_link_rates(inputs.link_gbps):
        at = dataclasses.replace(inputs, link_gbps=gbps)
        costs = {p.action: expected_ms(p, at, evidence) + p.load_ms for p in choose(at, codecs)
                 if p.action in worst}
        floor = min(costs.values())
        if floor <= 0:
            continue
        for action, ms in costs.items():
            worst[action] = max(worst[action], ms / floor)
    return worst


def safe_choice(ranked: list[Ranked], inputs: CostInputs, codecs: Iterable[str],
                evidence: Evidence = Evidence()) -> Ranked:
    """The unmeasured link's choice: among the actions whose worst-case regret is at most
    least + `SAMPLE_SHARE`·(least − 1), one that samples the link, then the least regret, then
    the ranking's order (the prior's). An action without regret anywhere needs no link sample."""
    worst = worst_regret(ranked, inputs, codecs, evidence)
    least = min(worst.values())
    bound = least + SAMPLE_SHARE * (least - 1) + 1e-9
    order = {r.prediction.action: i for i, r in enumerate(ranked)}
    return min((r for r in ranked if worst[r.prediction.action] <= bound), key=lambda r: (
        not samples_link(r.prediction.action, inputs, r.prediction.pipelined),
        worst[r.prediction.action],
        order[r.prediction.action]))


def samples_link(action: Action, inputs: CostInputs, pipelined: bool = False) -> bool:
    """Whether `action` puts at least `LINK_SAMPLE_BYTES` on the wire back-to-back before the
    decode side starts computing (what its link sample counts, see `transport.arrivals`):
    transfer-only, its whole prefix; otherwise the boundary's first chunk, after the prefix when
    streamed in layer order (`pipelined`: the first chunk alone, its prefix rows following it);
    token-only, nothing worth timing; the per-layer form, its first input rows (their recompute
    starts the decode side's compute). An approximation: a layer the sender holds back
    (encoding it, or computing it when streamed) ends a run."""
    shape, S = inputs.shape, inputs.prompt_len
    if action.cut == 0:
        return False
    if action.layer_split:
        return action.layer_split * shape.hidden_size * BF16_BYTES >= LINK_SAMPLE_BYTES
    wire = wire_bytes(action, shape, S)
    prefix = wire.prefix + wire.scales
    if action.cut == shape.num_layers:
        return prefix + wire.head >= LINK_SAMPLE_BYTES
    s0, s1 = chunk_bounds(action.split or S, inputs.chunk_tokens)[0]
    first_chunk = (s1 - s0) * shape.hidden_size * BF16_BYTES
    if action.split:  # only the prefix layers go ahead of a split's boundary
        prefix = wire_bytes(Action(action.codec, action.cut, shape.num_layers), shape, S)
        prefix = prefix.prefix + prefix.scales
    ahead = prefix if inputs.streamed and not pipelined else 0
    return first_chunk + ahead >= LINK_SAMPLE_BYTES


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
    action, pipelined = prediction.action, prediction.pipelined
    measured = usable(evidence, pipelined)
    own = measured.get(action)
    if own is not None:
        then_ms = _modelled_at(action, inputs, own.prompt_len, pipelined)
        return own.median_ms * prediction.total_ms / then_ms if then_ms > 0 else own.median_ms
    nearest = _nearest_measured(action, measured)
    if nearest is not None:
        neighbour, seen = nearest
        then_ms = _modelled_at(neighbour, inputs, seen.prompt_len, pipelined)
        if then_ms > 0:
            return prediction.total_ms * seen.median_ms / then_ms
    factor = evidence.over_model.get(action.kind, 0.0)
    return prediction.total_ms * (factor if factor > 0 else 1.0)


def _modelled_at(action: Action, inputs: CostInputs, prompt_len: int, pipelined: bool = False
                 ) -> float:
    """The model's time for `action` in this order at `prompt_len`, other inputs as now (γ linear
    in S)."""
    if inputs.streamed:
        inputs = dataclasses.replace(
            inputs, orders=frozenset({Order.TOKENS if pipelined else Order.LAYERS}))
    if prompt_len != inputs.prompt_len:
        inputs = dataclasses.replace(
            inputs, prompt_len=prompt_len,
            suffix_ms_per_layer=inputs.suffix_ms_per_layer * prompt_len / inputs.prompt_len)
    return predict(action, inputs).total_ms


def _nearest_measured(action: Action, usable: Mapping[Action, Measured]
                      ) -> tuple[Action, Measured] | None:
    """The measured action with the same codec whose cut is nearest (token-only has none; a token
    split's is a split's, and the per-layer form's is the per-layer form's, whose times have
    other shapes)."""
    if action.cut == 0:
        return None
    best = None
    for other, seen in usable.items():
        if (other.codec != action.codec or other.cut == 0 or bool(other.split) != bool(action.split)
                or bool(other.layer_split) != bool(action.layer_split)):
            continue
        rank = (abs(other.cut - action.cut), -seen.count)
        if best is None or rank < best[0]:
            best = (rank, other, seen)
    return None if best is None else (best[1], best[2])
