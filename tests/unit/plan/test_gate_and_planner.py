"""Teacher-forced scoring (`extend`), the quality gate on real weights at a small size, the policy
file and the planner's use of it."""

import dataclasses
import json

import pytest
import torch

from rekv_core.codecs import get_codec
from rekv_core.handoff import Action, ActionKind, Order
from rekv_core.model import KVCache, decode_step, extend, prefill
from rekv_core.model.shapes import get_preset
from rekv_core.plan import CostInputs, predict
from rekv_core.plan.calibration import codec_costs
from rekv_core.plan.gate import GateConfig, reconstructed_cache, run_gate, text_windows
from rekv_core.plan.evidence import Evidence, Measured
from rekv_core.plan.planner import Planner, expected_ms
from rekv_core.plan.policy import Policy, shipped_policy
from rekv_core.plan.recent import RecentHandoffs
from tests.support.coarse import with_coarse

TEXT = ("The history of the city begins with a small settlement on the river . Over the centuries "
        "it grew into a market town , then an industrial centre with mills and a railway . ") * 30


def test_extend_equals_prefill_and_decode_steps(smollm_fp32, tokenizer):
    ids = tokenizer.encode(TEXT)[:40]
    full = prefill(smollm_fp32, ids, boundaries=())
    head = prefill(smollm_fp32, ids[:30], boundaries=())
    cache = KVCache.from_layers(head.keys, head.values, 40)
    logits = extend(smollm_fp32, ids[30:], cache)
    assert logits.shape == (10, smollm_fp32.shape.vocab_size) and cache.length == 40
    torch.testing.assert_close(logits[-1], full.logits, atol=2e-3, rtol=2e-3)
    for layer in (0, 29):
        torch.testing.assert_close(cache.layer(layer)[0], full.keys[layer], atol=2e-3, rtol=2e-3)
    stepwise = KVCache.from_layers(head.keys, head.values, 40)
    for position, token in enumerate(ids[30:]):
        step = decode_step(smollm_fp32, token, stepwise)
        torch.testing.assert_close(logits[position], step, atol=2e-3, rtol=2e-3)


def test_reconstructed_cache_quantizes_only_the_prefix(smollm_bf16, tokenizer):
    state = prefill(smollm_bf16, tokenizer.encode(TEXT)[:24], boundaries=())
    cache = reconstructed_cache(state.keys, state.values, "int8", 10, 24)
    assert not torch.equal(cache.layer(3)[0], state.keys[3])
    assert torch.equal(cache.layer(10)[0], state.keys[10])
    assert torch.equal(cache.layer(29)[1], state.values[29])


def test_gate_passes_int8_and_names_what_fails(smollm_bf16, tokenizer):
    """int8 keeps the output; K and V at five levels through all 30 layers (`CoarseCodec`: a
    failure on every CPU, where a real codec's verdict rests on this CPU's BF16 roundings) does
    not, and says why; int4's verdict is whatever its own measures make it."""
    ids = tokenizer.encode(TEXT)
    config = GateConfig(prompt_len=48, prompts=3, continuation=24, needle_depths=(0.5,))
    actions = [("int8", 15), ("int8", 30), ("int4", 30), ("coarse", 30)]
    policy = run_gate(smollm_bf16, tokenizer, ids, actions, config,
                      codec_for=with_coarse(get_codec))
    verdicts = {(v["codec"], v["cut"]): v for v in policy.verdicts}
    assert set(verdicts) == set(actions)
    for v in verdicts.values():
        assert 0 <= v["next_token_top1_agreement"] <= 1 and v["next_token_kl"] >= 0
        assert v["eligible"] == (not v["reasons"])
    broken = verdicts["coarse", 30]
    assert verdicts["int8", 15]["perplexity_rise"] < broken["perplexity_rise"]
    assert broken["continuation_kl"] > verdicts["int8", 30]["continuation_kl"]
    assert verdicts["int8", 15]["eligible"] and verdicts["int8", 30]["eligible"]
    assert not broken["eligible"]
    assert any("perplexity" in reason for reason in broken["reasons"])
    int4_cut = 30 if verdicts["int4", 30]["eligible"] else 0
    assert policy.max_cut == {"int8": 30, "int4": int4_cut, "coarse": 0}
    assert policy.meta.prompts == 3 and len(policy.meta.bf16_needles) == 1


def test_text_windows_cover_the_text():
    windows = text_windows(list(range(100)), 10, 4)
    assert [w[0] for w in windows] == [0, 30, 60, 90] and all(len(w) == 10 for w in windows)
    with pytest.raises(ValueError, match="text"):
        text_windows([1, 2], 10, 1)


def _policy(max_cut):
    return Policy("smollm2-135m", (1, 2048), max_cut)


def test_policy_round_trips_and_gates_actions(tmp_path):
    policy = _policy({"int8": 21, "int4": 0})
    path = tmp_path / "p.json"
    policy.save(path)
    loaded = Policy.load(path)
    assert loaded.max_cut == {"int8": 21, "int4": 0}
    assert loaded.eligible(Action("int8", 21, 30)) and not loaded.eligible(Action("int8", 24, 30))
    assert not loaded.eligible(Action("int4", 3, 30))
    assert loaded.eligible(Action("bf16", 30, 30)) and loaded.eligible(Action.token_only(30))
    path.write_text(json.dumps({"model": "x"}))
    with pytest.raises(ValueError, match="policy"):
        Policy.load(path)


def test_planner_keeps_to_eligible_actions_and_applies_corrections():
    shape = get_preset("smollm2-135m")
    inputs = CostInputs(shape, 2048, 0.4, 30.0, codec_costs({"bf16": 0.0, "int8": 0.5},
                                                            {"bf16": 0.01, "int8": 0.01}), 1.0)
    free = Planner(_policy({"int8": 30})).decide(inputs, ["bf16", "int8"])
    assert free.action.kind.value == "joint"
    capped = Planner(_policy({"int8": 8})).decide(inputs, ["bf16", "int8"])
    assert all(p.action.codec != "int8" or p.action.cut <= 8 for p, _ in capped.candidates)
    assert Planner(None).decide(inputs, ["int8", "bf16"]).action.codec == "bf16"
    outside = Planner(_policy({"int8": 30})).decide(
        CostInputs(shape, 4096, 0.4, 30.0, codec_costs({"int8": 0.5}, {})), ["int8", "bf16"])
    assert outside.action.codec == "bf16" or outside.action.cut == 0
    slow = Evidence(over_model={ActionKind.JOINT: 10.0})
    slow_joint = Planner(_policy({"int8": 30})).decide(inputs, ["bf16", "int8"], slow)
    assert slow_joint.action.kind.value != "joint"  # measured 10x slower than modelled
    # an action's own recent handoffs override its kind's ratio, once there are enough of them
    own = Planner(_policy({"int8": 30})).decide(inputs, ["bf16", "int8"], Evidence(
        slow.over_model, {Action("int8", 20, 30): Measured(1.0, 2048, 3)}))
    assert own.action == Action("int8", 20, 30) and own.predicted_ms == 1.0
    few = Planner(_policy({"int8": 30})).decide(inputs, ["bf16", "int8"], Evidence(
        slow.over_model, {Action("int8", 20, 30): Measured(1.0, 2048, 2)}))
    assert few.action != Action("int8", 20, 30)
    # measured at another prompt length: scaled by the model from there to here
    half = Planner(_policy({"int8": 30})).decide(inputs, ["bf16", "int8"], Evidence(
        slow.over_model, {Action("int8", 20, 30): Measured(1.0, 1024, 5)}))
    scaled = next(ms for p, ms in half.candidates if p.action == Action("int8", 20, 30))
    # 1.0 ms times the model's time here over its time at 1024 tokens, where γ is half (linear
    # in S): about 1.995, not S's ratio of 2
    then = dataclasses.replace(inputs, prompt_len=1024, suffix_ms_per_layer=15.0)
    assert scaled == pytest.approx(1.0 * predict(Action("int8", 20, 30), inputs).total_ms
                                   / predict(Action("int8", 20, 30), then).total_ms, rel=1e-9)
    # an unmeasured cut takes the ratio of the nearest measured cut with its codec
    int8_30 = next(p for p, _ in free.candidates if p.action == Action("int8", 30, 30))
    seen = {Action("int8", 30, 30): Measured(3 * int8_30.total_ms, 2048, 3),
            Action("int8", 10, 30): Measured(1.0, 2048, 3)}
    near = Planner(_policy({"int8": 30})).decide(inputs, ["bf16", "int8"], Evidence(measured=seen))
    by_action = {p.action: (p.total_ms, ms) for p, ms in near.candidates}
    model_ms, expected = by_action[Action("int8", 27, 30)]
    assert expected == pytest.approx(3 * model_ms)
    model_ms, expected = by_action[Action("int8", 12, 30)]  # nearer to 10
    assert expected < model_ms
    model_ms, expected = by_action[Action("bf16", 12, 30)]  # no bf16 cut measured: its kind's
    assert expected == model_ms
    # a measured action within the margin wins over an unmeasured one expected a little faster
    best, best_ms = free.candidates[0]
    runner, runner_ms = next((p, ms) for p, ms in free.candidates[1:] if ms <= best_ms * 1.05)
    known = Evidence(measured={runner.action: Measured(runner_ms, 2048, 3)})  # ratio 1
    assert Planner(_policy({"int8": 30})).decide(inputs, ["bf16", "int8"],
                                                 known).action == runner.action
    assert Planner(_policy({"int8": 30}), hysteresis=0).decide(
        inputs, ["bf16", "int8"], known).action == best.action
    # a forced action is evaluated like any other: the same expectation, the same ranking
    forced = Planner(_policy({"int8": 30})).decide(inputs, ["bf16", "int8"], known,
                                                   forced=runner.action)
    assert forced.forced and forced.action == runner.action
    assert forced.predicted_ms == pytest.approx(runner_ms) and forced.candidates == near_ranking(
        inputs, known)


def near_ranking(inputs, evidence):
    return Planner(_policy({"int8": 30})).decide(inputs, ["bf16", "int8"], evidence).candidates

def test_recent_handoffs_offer_fresh_measurements_over_a_like_link():
    clock = [0.0]
    recent = RecentHandoffs(window=3, max_age_s=100, link_tolerance=2.0, clock=lambda: clock[0])
    for measured in (100, 10, 20, 30, 40):  # the first, cold, is left out; the window keeps 3
        recent.observe(Action("int8", 21, 30), 1024, 10.0, measured, link_gbps=1.0)
    recent.observe(Action("int8", 9, 30), 256, 10.0, 50.0, link_gbps=1.0)  # cold: left out
    recent.observe(Action("int8", 9, 30), 256, 10.0, 5.0, link_gbps=1.0)
    assert recent.corrections(1.0) == {ActionKind.JOINT: 3.0}  # 30, 40 and 5 over 10
    assert recent.corrections(3.0) == {}
    a21, a9 = Action("int8", 21, 30), Action("int8", 9, 30)
    assert recent.measured(1100, 1.0) == {a21: Measured(30.0, 1024, 3)}
    assert recent.measured(256, 1.5) == {a9: Measured(5.0, 256, 1)}
    assert recent.measured(256, 2.5) == {}  # measured over a link unlike today's
    clock[0] = 50.0
    recent.observe(Action("int8", 21, 30), 1500, 10.0, 100.0, link_gbps=4.0)
    assert recent.measured(1024, 1.0) == {a21: Measured(35.0, 1024, 2)}
    assert recent.measured(1024, 4.0) == {a21: Measured(100.0, 1500, 1)}
    clock[0] = 120.0  # the first ones aged out
    assert recent.measured(1024, 1.0) == {}
    assert recent.measured(1024, 4.0) == {a21: Measured(100.0, 1500, 1)}


def test_the_embedded_models_policy_ships_with_its_verdicts():
    policy = shipped_policy("smollm2-135m")
    assert policy is not None, "rekv_core/plan/policies/smollm2-135m.json is not in the package"
    assert policy.model == "smollm2-135m" and policy.covers(2048)
    assert policy.max_cut == {"int8": 0, "int4": 0, "int4h": 0, "spectrum30": 0,
                              "spectrum50": 0, "splitzip": 30}  # re-gated by generations
    assert len(policy.splitzip_codebook("kv")) == len(policy.splitzip_codebook("boundary")) == 16
    assert policy.meta.spectrum_probe.int4_tolerated
    for v in policy.verdicts:  # every verdict agrees with the cut it vouches for
        assert v["eligible"] == (v["cut"] <= policy.max_cut[v["codec"]]), v
    assert shipped_policy("no-such-model") is None


def test_the_shipped_policy_was_judged_by_its_generations():
    """`rekv regate` (bench/results/regate-smollm2-135m.md): every lossy codec's max cut meets
    the generation floor, and the actions the issue saw change an answer within a dozen tokens
    (Hadamard INT4 at cut 14, the planner's pick at cut 29) are no longer admitted."""
    policy = shipped_policy("smollm2-135m")
    record = policy.meta.generation
    assert record["floor"] == {"min_agreed_tokens": 16, "min_exact_share": 0.75}
    assert record["tokens"] == 48
    assert {p["kind"] for p in record["prompts"]} == {"code", "chat", "prose", "passkey"}
    assert not policy.eligible(Action("int4h", 14, 30))
    assert not policy.eligible(Action("int4h", 29, 30))
    for codec, search in record["codecs"].items():
        assert policy.max_cut[codec] == search["max_cut"] <= search["max_cut_before"]
        assert all(e["passed"] for e in search["evaluated"] if e["cut"] <= search["max_cut"])
        above = [e["passed"] for e in search["evaluated"] if e["cut"] == search["max_cut"] + 1]
        assert not any(above)


def test_top1_agreement_accepts_exact_bf16_ties_only():
    from rekv_core.plan.gate import _score, _Tally

    reference = torch.tensor([[0.0, 2.0, 2.0, 1.0], [0.0, 2.0, 1.9921875, 1.0]])
    action = torch.tensor([[0.0, 1.0, 3.0, 0.0], [0.0, 1.0, 3.0, 0.0]])  # picks token 2 twice
    tally = _Tally()
    _score(action, reference, torch.tensor([1]), tally)
    assert tally.first_agree == 1  # token 2 ties BF16's maximum at position 0
    assert tally.all_agree == 1 and tally.positions == 2  # at position 1 it is 1/128 below


def test_planner_keeps_its_previous_choice_among_near_equals():
    shape = get_preset("smollm2-135m")

    def inputs(gamma, gbps=0.4):
        return CostInputs(shape, 2048, gbps, gamma, codec_costs({"bf16": 0.0, "int8": 0.5},
                                                                {"bf16": 0.01, "int8": 0.01}), 1.0)

    planner = Planner(_policy({"int8": 30}), explore_every=0)
    first = planner.decide(inputs(30.0), ["bf16", "int8"]).action
    # a slightly slower suffix moves the balanced cut: a fresh planner picks another cut ...
    moved = Planner(_policy({"int8": 30}), hysteresis=0).decide(inputs(36.0), ["bf16", "int8"])
    assert moved.action != first
    # ... while this one keeps its choice, whose prediction is still within 10% of the best
    assert planner.decide(inputs(36.0), ["bf16", "int8"]).action == first
    # a settling link estimate (0.4 -> 0.34 Gb/s, across 2^-1.5) keeps it too
    assert planner.decide(inputs(36.0, 0.34), ["bf16", "int8"]).action == first
    # far from the old regime, it moves
    assert planner.decide(inputs(300.0), ["bf16", "int8"]).action != first


def test_a_change_of_link_moves_the_choice_within_a_few_requests():
    """The decode side's memory, link estimate and the planner in a loop, against a world whose
    handoffs take 20% longer than modelled: the choice follows the link both ways."""
    from rekv_core.plan.cost import choose, predict
    from rekv_core.plan.estimates import LinkEstimate

    shape = get_preset("smollm2-135m")
    S, codecs = 2048, ["bf16", "int8"]

    def world(gbps):
        return CostInputs(shape, S, gbps, 30.0, codec_costs({"bf16": 0.0, "int8": 0.5},
                                                            {"bf16": 0.01, "int8": 0.01}), 1.0)

    planner = Planner(_policy({"int8": 30}), explore_every=0)
    recent, link = RecentHandoffs(), LinkEstimate(min_bytes=1)
    link.observe(10**7, 10**7 * 8 / 1e9)  # 1 Gb/s to start from
    clock = [0.0]
    recent._clock = lambda: clock[0]

    def serve(true_gbps):
        inputs = world(link.gbps)
        decision = planner.decide(inputs, codecs, Evidence(recent.corrections(link.gbps),
                                                           recent.measured(S, link.gbps)))
        measured = predict(decision.action, world(true_gbps)).total_ms * 1.2
        recent.observe(decision.action, S, decision.model_ms, measured, link.gbps)
        link.observe(10**7, 10**7 * 8 / (true_gbps * 1e9))
        clock[0] += 1.0
        return decision.action, measured

    def best(true_gbps):
        return choose(world(true_gbps), codecs)[0].total_ms * 1.2

    for slow, fast in ((0.2, 40.0), (40.0, 0.2)):
        for _ in range(20):
            serve(slow)
        settled, ms = serve(slow)
        assert ms <= 1.1 * best(slow)
        taken = [serve(fast) for _ in range(8)]
        assert taken[0][0] == settled  # the estimate has not moved yet
        assert all(ms <= 1.1 * best(fast) for _, ms in taken[5:])
        assert {a.kind.value for a, _ in taken[5:]} != {settled.kind.value}


def test_a_policy_takes_a_newer_gate_run_of_other_codecs():
    from rekv_core.plan.policy import Policy

    def verdict(codec, cut, ok):
        return {"codec": codec, "cut": cut, "eligible": ok, "bf16_perplexity": 16.9}

    meta = {"bf16_needles": [{"depth": 0.5, "found": True}]}
    old = Policy("m", (1, 2048), {"int8": 30, "int4": 9},
                 verdicts=[verdict("int8", 30, True), verdict("int4", 9, True)], meta=meta)
    new = Policy("m", (1, 2048), {"int4h": 24, "int4": 3},
                 verdicts=[verdict("int4h", 24, True), verdict("int4", 3, True)],
                 meta={**meta, "splitzip": {"kv": list(range(16))}})
    merged = old.merged(new)
    assert merged.max_cut == {"int8": 30, "int4": 3, "int4h": 24}
    assert [(v["codec"], v["cut"]) for v in merged.verdicts] == [("int8", 30), ("int4h", 24),
                                                                 ("int4", 3)]
    assert merged.splitzip_codebook("kv") == list(range(16))
    assert merged.codec("splitzip").codebook == list(range(16))  # what the prefill encodes with
    assert old.codec("splitzip").codebook is None  # no calibration: each layer ranks its own
    other = Policy("m", (1, 2048), {}, verdicts=[{**verdict("x", 1, True),
                                                  "bf16_perplexity": 20.0}], meta=meta)
    with pytest.raises(ValueError, match="different models or evaluations"):
        old.merged(other)


def test_logits_one_bf16_ulp_apart_are_tied_at_bf16_resolution():
    from rekv_core.plan.gate import within_resolution

    top = torch.tensor([22.125, 22.125, 0.75])
    picked = torch.tensor([22.0, 21.875, 0.75 - 2 ** -8])  # 1 ulp, 2 ulps, 1 ulp below
    assert within_resolution(picked, top, torch.bfloat16).tolist() == [True, False, True]
    assert within_resolution(picked, top, torch.float32).tolist() == [False, False, False]


def test_a_model_that_fails_the_spectrum_probe_runs_spectrum_without_int4():
    from rekv_core.plan.policy import deployed_codec

    failed = Policy("smollm2-135m", (1, 2048), {"int8": 30, "spectrum30": 18, "spectrum50": 30},
                    meta={"spectrum_probe": {"int4_tolerated": False, "tiers": 2}})
    two_tier = failed.codec("spectrum50")  # what the prefill worker encodes with
    assert (two_tier.name, two_tier.tiers, two_tier.budget) == ("spectrum50", 2, 0.5)
    with pytest.raises(ValueError, match="codec: spectrum30 is ruled out"):
        failed.codec("spectrum30")  # no FP16 + INT8 form spends only 0.3 of FP16
    L = 30
    assert not failed.eligible(Action("spectrum30", 6, L))  # whatever max_cut an older run gave
    assert failed.eligible(Action("spectrum50", 30, L)) and failed.eligible(Action("int8", 6, L))
    costs = {"bf16": 0.0, "int8": 0.5, "spectrum30": 0.1, "spectrum50": 0.1}
    world = CostInputs(get_preset("smollm2-135m"), 2048, 0.4, 30.0, codec_costs(costs, costs), 1.0)
    offered = {p.action.codec for p, _ in Planner(failed).decide(world, list(costs)).candidates}
    assert "spectrum50" in offered and "spectrum30" not in offered

    passed = Policy("smollm2-135m", (1, 2048), {"spectrum30": 18},
                    meta={"spectrum_probe": {"int4_tolerated": True, "tiers": 3}})
    assert passed.codec("spectrum30").tiers == 3 and passed.eligible(Action("spectrum30", 6, L))
    assert deployed_codec("spectrum30", {}).tiers == 3  # no probe: the gate's verdicts stand
    assert deployed_codec("spectrum30", {"spectrum_probe": None}).tiers == 3
    # a later run whose probe changed the tier mode cannot leave an older SpectrumKV verdict
    # standing for the other form: it must gate that codec again
    needles = {"bf16_needles": []}
    older = Policy("smollm2-135m", (1, 2048), {"spectrum50": 30, "int8": 30},
                   meta={**passed.meta.to_json(), **needles})
    with pytest.raises(ValueError, match="now gives 2 tiers, not 3; gate spectrum50 again"):
        older.merged(Policy("smollm2-135m", (1, 2048), {"int4h": 30},
                            meta={**failed.meta.to_json(), **needles}))
    newer = Policy("smollm2-135m", (1, 2048), {"spectrum50": 24},
                   meta={**failed.meta.to_json(), **needles})
    assert older.merged(newer).max_cut["spectrum50"] == 24
    assert deployed_codec("int8", failed.meta).name == "int8"


def test_measurements_count_only_for_the_order_they_were_sent_in():
    """The same action pipelined and in layer order takes two different times: each order's
    recent handoffs speak for its own predictions only, and the first of each is the cold one."""
    recent = RecentHandoffs()
    action = Action("int8", 15, 30)
    for ms in (900.0, 400.0, 410.0, 420.0):  # the first, cold, is left out
        recent.observe(action, 512, 500.0, ms, 1.0, pipelined=True)
    for ms in (900.0, 600.0, 610.0, 620.0):
        recent.observe(action, 512, 500.0, ms, 1.0)
    assert recent.measured(512, 1.0, pipelined=True)[action] == Measured(410.0, 512, 3)
    assert recent.measured(512, 1.0)[action] == Measured(610.0, 512, 3)
    evidence = Evidence(measured=recent.measured(512, 1.0),
                        measured_pipelined=recent.measured(512, 1.0, pipelined=True))
    inputs = CostInputs(get_preset("smollm2-135m"), 512, 1.0, 2.0, codec_costs({"int8": 0.5}, {}),
                        prefill_ms_per_layer=2.0, streamed=True, chunk_tokens=256)
    for order, own in ((frozenset({Order.TOKENS}), 410.0), (frozenset({Order.LAYERS}), 610.0)):
        prediction = predict(action, dataclasses.replace(inputs, orders=order))
        assert expected_ms(prediction, dataclasses.replace(inputs, orders=order),
                           evidence) == pytest.approx(own)
