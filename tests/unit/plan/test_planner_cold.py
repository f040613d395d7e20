"""The planner cold: before the link is measured and before an action is warm
(`rekv_core.plan.planner`, `recent`); on a machine whose profile it has not measured yet:
test_profile_cache.py."""

import dataclasses

import pytest

from rekv_core.handoff import Action, ActionKind
from rekv_core.model.shapes import get_preset
from rekv_core.plan import CostInputs
from rekv_core.plan import planner as plan
from rekv_core.plan.calibration import (DecodeCalibration, PrefillCalibration, Queues,
                                        codec_costs)
from rekv_core.plan.cost import choose, predict
from rekv_core.plan.estimates import LayerCost
from rekv_core.plan.evidence import Evidence, Measured
from rekv_core.plan.planner import Planner, Rule
from rekv_core.plan.policy import shipped_policy
from rekv_core.plan.profile import shipped_profile
from rekv_core.plan.recent import RecentHandoffs

SHAPE = get_preset("smollm2-135m")
L = SHAPE.num_layers
CODECS = ["bf16", "int8", "int4"]
PRIOR_GBPS = 10.0  # the services' default --link-gbps
RATES = [10 ** (e / 4) for e in range(-8, 9)]  # 0.01 .. 100 Gb/s
# The unmeasured-link choice is within this factor of the best action, and of full BF16 transfer,
# at every rate of RATES; the choice on the prior alone is off by more than twice that somewhere.
SAFE_FACTOR = 3.0


def _fresh_inputs(prompt_len, streamed, compute_scale=1.0, load=1) -> CostInputs:
    """What a fresh pair's planner sees: both workers on the shipped profile (its compute scaled
    by `compute_scale`: 10 is a CPU without AVX-512 BF16), no handoff yet, the link a prior."""
    profile = shipped_profile("smollm2-135m")
    layers = LayerCost(profile.layer_cost.lengths,
                       [ms * compute_scale for ms in profile.layer_cost.ms])
    costs = DecodeCalibration(SHAPE, layers, profile.restore_ms_per_mib).offer(prompt_len, load)
    assert costs.link_gbps is None  # unmeasured
    prefill = PrefillCalibration(profile.quantize_ms_per_mib, PRIOR_GBPS, layers)
    inputs = prefill.cost_inputs(SHAPE, prompt_len, costs, streamed, 256 if streamed else 0,
                                 load=Queues(decode_queue=load - 1))
    assert not inputs.link_measured and inputs.link_gbps == PRIOR_GBPS
    return dataclasses.replace(inputs, link_measured=True)  # what a planner trusting it sees


def _cost(action, inputs):
    p = predict(action, inputs)
    return p.total_ms + p.load_ms


def _worst_over_rates(action, inputs, planner):
    """(largest ratio to the best allowed action, largest ratio to full BF16) over RATES."""
    to_best = to_bf16 = 0.0
    for gbps in RATES:
        at = dataclasses.replace(inputs, link_gbps=gbps)
        best = min(p.total_ms + p.load_ms for p in choose(at, CODECS)
                   if planner.allowed(p.action, at.prompt_len))
        ms = _cost(action, at)
        to_best = max(to_best, ms / best)
        to_bf16 = max(to_bf16, ms / _cost(Action.full_bf16(L), at))
    return to_best, to_bf16


def unmeasured(inputs):
    """`inputs` whose link rate is only a prior."""
    return dataclasses.replace(inputs, link_measured=False)


def test_the_first_choice_on_an_unmeasured_link_is_safe_at_every_rate():
    planner = Planner(shipped_policy("smollm2-135m"), explore_every=0)
    plain_worst = 0.0
    for compute_scale in (1.0, 10.0):
        for streamed in (False, True):
            for load in (1, 3):
                for prompt_len in (64, 256, 1024, 2048):
                    inputs = _fresh_inputs(prompt_len, streamed, compute_scale, load)
                    case = (compute_scale, streamed, load, prompt_len)
                    safe = planner.decide(unmeasured(inputs), CODECS)
                    assert safe.rule is Rule.UNMEASURED_LINK and not safe.forced
                    to_best, to_bf16 = _worst_over_rates(safe.action, inputs, planner)
                    assert to_best <= SAFE_FACTOR and to_bf16 <= SAFE_FACTOR, (case, safe.action)
                    plain = Planner(planner.policy, explore_every=0).decide(inputs, CODECS)
                    assert plain.rule is Rule.BEST
                    plain_worst = max(plain_worst, _worst_over_rates(plain.action, inputs,
                                                                     planner)[0])
    assert plain_worst > 2 * SAFE_FACTOR  # trusting the 10 Gb/s prior can go badly wrong


def test_the_unmeasured_link_choice_samples_the_link_when_that_costs_little():
    planner = Planner(shipped_policy("smollm2-135m"), explore_every=0)
    sampled = 0
    for streamed in (False, True):
        for prompt_len in (256, 1024, 2048):
            inputs = _fresh_inputs(prompt_len, streamed, load=3)
            decision = planner.decide(unmeasured(inputs), CODECS)
            worst = plan.worst_regret(decision.candidates, unmeasured(inputs), CODECS)
            least = min(worst.values())
            near = [a for a, w in worst.items()
                    if w <= least + plan.SAMPLE_SHARE * (least - 1) + 1e-9]
            assert worst[decision.action] in [worst[a] for a in near]
            if any(plan.samples_link(a, inputs) for a in near):
                assert plan.samples_link(decision.action, inputs)
                sampled += 1
    assert sampled >= 4  # the case this test is about does occur
    # token-only ahead everywhere: no regret, so no link sample is worth paying for
    inputs = _fresh_inputs(1024, streamed=True)
    decision = planner.decide(unmeasured(inputs), CODECS)
    assert decision.action == Action.token_only(L)
    assert not plan.samples_link(decision.action, inputs)


def test_a_forced_action_is_kept_on_an_unmeasured_link():
    planner = Planner(shipped_policy("smollm2-135m"))
    inputs = _fresh_inputs(1024, streamed=False)
    forced = planner.decide(unmeasured(inputs), CODECS, forced=Action.full_bf16(L))
    assert forced.action == Action.full_bf16(L) and forced.forced and forced.rule is Rule.FORCED


def test_the_first_handoff_of_an_action_is_not_its_measurement():
    recent = RecentHandoffs()
    joint, other = Action("int8", 20, L), Action("int8", 10, L)
    recent.observe(joint, 1024, 80.0, 435.0, link_gbps=2.0)  # the cold one: 5x its warm time
    assert recent.measured(1024, 2.0) == {} and recent.corrections(2.0) == {}
    for _ in range(3):
        recent.observe(joint, 1024, 80.0, 88.0, link_gbps=2.0)
    assert recent.measured(1024, 2.0) == {joint: Measured(88.0, 1024, 3)}
    assert recent.corrections(2.0) == {ActionKind.JOINT: pytest.approx(1.1)}
    # another action, or the same one at another length, is cold again
    recent.observe(other, 1024, 80.0, 800.0, link_gbps=2.0)
    recent.observe(joint, 200, 20.0, 300.0, link_gbps=2.0)
    assert set(recent.measured(1024, 2.0)) == {joint} and recent.measured(200, 2.0) == {}
    assert recent.corrections(2.0) == {ActionKind.JOINT: pytest.approx(1.1)}


def _exploring_world():
    """Inputs, the shipped policy and its allowed predictions, cheapest first."""
    inputs = CostInputs(SHAPE, 2048, 0.4, 30.0, codec_costs({"bf16": 0.0, "int8": 0.5},
                                                            {"bf16": 0.01, "int8": 0.01}), 1.0)
    policy = shipped_policy("smollm2-135m")
    allowed = [p for p in choose(inputs, ["bf16", "int8"])
               if Planner(policy).allowed(p.action, inputs.prompt_len)]
    return inputs, policy, allowed


def _every_measured_but(allowed, spared):
    """Evidence that measured every allowed action at its model's time, except `spared`."""
    return Evidence(measured={p.action: Measured(p.total_ms, 2048, 3) for p in allowed
                              if p.action not in spared})


def _near_unmeasured():
    """The exploring world with one near action left unmeasured: (inputs, policy, allowed, that
    action, the evidence)."""
    inputs, policy, allowed = _exploring_world()
    best_ms = allowed[0].total_ms
    near = next(p.action for p in allowed
                if 1.1 * best_ms < p.total_ms < plan.EXPLORE_FACTOR * best_ms)
    return inputs, policy, allowed, near, _every_measured_but(allowed, {near})


def test_exploration_tries_a_near_unmeasured_action_every_nth_decision():
    inputs, policy, allowed, near, evidence = _near_unmeasured()
    planner = Planner(policy, explore_every=4)
    rules = []
    for i in range(1, 13):
        if i == 6:  # forced decisions neither count nor explore
            forced = planner.decide(inputs, ["bf16", "int8"], evidence, forced=near)
            assert forced.rule is Rule.FORCED
        decision = planner.decide(inputs, ["bf16", "int8"], evidence)
        rules.append(decision.rule)
        if i % 4 == 0:
            assert decision.action == near and decision.rule is Rule.EXPLORE
        else:
            assert decision.action == allowed[0].action and decision.rule is Rule.BEST
    assert rules.count(Rule.EXPLORE) == 3
    # the exploring decision did not become the remembered choice
    assert planner.decide(inputs, ["bf16", "int8"], evidence).action == allowed[0].action
    # off: never
    quiet = Planner(policy, explore_every=0)
    assert all(quiet.decide(inputs, ["bf16", "int8"], evidence).rule is Rule.BEST
               for _ in range(12))


def test_exploration_waits_for_both_workers_to_be_idle():
    """A due exploration under load (a queue on either worker) is not made; the bucket's next
    idle decision makes it, and the count goes on from there: the 4th decision is loaded, the
    5th explores, the 8th again."""
    inputs, policy, allowed, near, evidence = _near_unmeasured()
    planner = Planner(policy, explore_every=4)
    loaded = {4: dataclasses.replace(inputs, prefill_queue=1),
              6: dataclasses.replace(inputs, decode_queue=2)}
    rules = [planner.decide(loaded.get(i, inputs), ["bf16", "int8"], evidence).rule
             for i in range(1, 10)]
    assert rules == [Rule.BEST] * 4 + [Rule.EXPLORE] + [Rule.BEST] * 2 + [Rule.EXPLORE, Rule.BEST]
    # a decision under load never explores, however due
    busy = Planner(policy, explore_every=1)
    assert all(busy.decide(loaded[6], ["bf16", "int8"], evidence).rule is Rule.BEST
               for _ in range(5))
    assert busy.decide(inputs, ["bf16", "int8"], evidence).rule is Rule.EXPLORE


def test_exploration_never_tries_a_far_action():
    inputs, policy, allowed = _exploring_world()
    best_ms = allowed[0].total_ms
    far = {p.action for p in allowed if p.total_ms > plan.EXPLORE_FACTOR * best_ms}
    assert far
    evidence = _every_measured_but(allowed, far)
    planner = Planner(policy, explore_every=2)
    for _ in range(8):
        decision = planner.decide(inputs, ["bf16", "int8"], evidence)
        assert decision.action == allowed[0].action and decision.rule is Rule.BEST


def test_exploration_weighs_a_candidates_load_and_takes_one_at_its_bound():
    """A candidate is near while its time plus the wait it puts on the queue is at most
    EXPLORE_FACTOR times best's: a quick one whose load pushes it past is not tried, one exactly
    at the bound is."""
    from rekv_core.plan.cost import Prediction

    def ranked(cut, total_ms, load_ms):
        prediction = Prediction(Action("bf16", cut, 30), total_ms, 0.0, 0.0, 0.0, 0.0, 0,
                                load_ms=load_ms)
        return plan.Ranked(prediction, total_ms)

    best = ranked(30, 100.0, 0.0)
    known = plan._Known(Evidence())
    loaded, at_bound = ranked(20, 100.0, 60.0), ranked(10, 140.0, 10.0)
    assert plan._exploration([best, loaded, at_bound], known, best) is at_bound
    assert plan._exploration([best, loaded], known, best) is None


@pytest.mark.parametrize("true_gbps", [0.06, 2.0, 40.0])
def test_a_fresh_pair_settles_on_the_best_action_despite_the_prior_and_the_cold_handoffs(
        true_gbps):
    """The decode side's memory and link estimate and the planner in a loop, fresh, on the 10 Gb/s
    prior, against a world whose first handoff of each action takes 5x its time: the first request
    is safe, the link is measured by the second, and the cold handoffs do not stick."""
    from rekv_core.plan.estimates import LinkEstimate

    world = _fresh_inputs(1024, streamed=False)
    planner = Planner(shipped_policy("smollm2-135m"), explore_every=0)
    recent, link = RecentHandoffs(), LinkEstimate(min_bytes=plan.LINK_SAMPLE_BYTES)
    truth = dataclasses.replace(world, link_gbps=true_gbps)
    best = min(_cost(p.action, truth) for p in choose(truth, CODECS)
               if planner.allowed(p.action, 1024))
    seen, took = set(), []
    for _ in range(12):
        gbps = link.or_prior(PRIOR_GBPS)
        inputs = dataclasses.replace(world, link_gbps=gbps, link_measured=link.measured)
        decision = planner.decide(inputs, CODECS, Evidence(recent.corrections(gbps),
                                                           recent.measured(1024, gbps)))
        ms = _cost(decision.action, truth) * (1 if decision.action in seen else 5)
        seen.add(decision.action)
        if plan.samples_link(decision.action, inputs):
            link.observe(plan.LINK_SAMPLE_BYTES, plan.LINK_SAMPLE_BYTES * 8 / (true_gbps * 1e9))
        recent.observe(decision.action, 1024, decision.model_ms, ms, link.or_prior(PRIOR_GBPS))
        took.append((decision.rule, _cost(decision.action, truth) / best))
    assert took[0][0] is Rule.UNMEASURED_LINK and took[0][1] <= SAFE_FACTOR
    assert took[1][0] is Rule.BEST  # planned on a measured link
    assert all(ratio <= 1.1 for _, ratio in took[3:]), took
