"""Generation agreement in the quality gate: greedy continuations from an action's cache against
BF16's, the floor, the cut search, and re-gating a policy by it (real weights, short prompts).

What a lossy codec's generations do depends on the CPU's BF16 kernels, so the tests that must see
an action fail use `coarse`: the prefix's K and V rounded to five levels (the services' injected
fault), which leaves BF16's greedy output at once on every machine. A real lossy codec (int4) is
checked only for what holds wherever it runs: its verdict is the floor's on its own divergences.
"""

from types import SimpleNamespace

import pytest

from rekv_core.codecs import get_codec
from rekv_core.eval.generation_set import CHAT, CODE, GenerationPrompt, generation_prompts
from rekv_core.plan import generations
from rekv_core.plan.gate import GateConfig, regate_generations, run_gate
from rekv_core.plan.generations import GenerationFloor, GenerationScore, largest_passing_cut
from rekv_core.plan.policy import Policy, deployed_codec
from tests.support.coarse import with_coarse

TEXT = ("The history of the city begins with a small settlement on the river . Over the centuries "
        "it grew into a market town , then an industrial centre with mills and a railway . ") * 30


def _prompts(tokenizer):
    return [GenerationPrompt("code", tuple(tokenizer.encode(CODE[0]))),
            GenerationPrompt("chat", tuple(tokenizer.encode(CHAT[0])))]


def _floor_verdict(verdict: dict) -> list[str]:
    """What the generation floor says of a verdict's own divergences."""
    divergences = verdict["generation_divergences"]
    return GenerationFloor().reasons(GenerationScore(
        tuple(d["kind"] for d in divergences), tuple(d["first_divergence"] for d in divergences),
        verdict["generation_tokens"]))


def test_the_gate_fails_generations_that_leave_bf16_early_and_passes_a_lossless_codec(
        smollm_bf16, tokenizer):
    config = GateConfig(prompt_len=48, prompts=1, continuation=8, needle_depths=(),
                        generation_tokens=24)
    policy = run_gate(smollm_bf16, tokenizer, tokenizer.encode(TEXT),
                      [("splitzip", 30), ("int4", 30), ("coarse", 30)], config,
                      generation=_prompts(tokenizer), codec_for=with_coarse(get_codec))
    verdicts = {v["codec"]: v for v in policy.verdicts}
    lossless, broken, int4 = verdicts["splitzip"], verdicts["coarse"], verdicts["int4"]
    assert lossless["eligible"] and lossless["generation_exact_share"] == 1.0
    assert lossless["generation_earliest_divergence"] == 24
    # five levels through every layer leave BF16's greedy output within a few tokens
    assert not broken["eligible"] and 1 <= broken["generation_earliest_divergence"] < 16
    assert any("before token 16" in reason for reason in broken["reasons"])
    assert policy.max_cut["coarse"] == 0 and policy.meta.generation["tokens"] == 24
    # int4's verdict follows the floor on the divergences it measured here, whatever they are
    failing = _floor_verdict(int4)
    assert set(failing) <= set(int4["reasons"]) and (not failing or not int4["eligible"])
    assert int4["generation_earliest_divergence"] >= 1  # the first token is the exact suffix's


def test_the_floor_fails_an_early_divergence_or_too_few_exact_continuations():
    floor = GenerationFloor()
    late = GenerationScore(("code", "chat", "prose", "passkey"), (48, 48, 48, 20), 48)
    assert floor.reasons(late) == [] and late.exact_share == 0.75
    early = GenerationScore(("code", "chat", "prose", "passkey"), (48, 11, 48, 48), 48)
    assert floor.reasons(early) == ["greedy output leaves BF16's before token 16 on 1 of 4 "
                                    "prompts (chat at token 11)"]
    assert floor.reasons(GenerationScore(("code",), (8,), 8)) == []  # 8 of 8 tokens match
    # a search stops decoding once the rest of the prompts cannot save the action
    assert floor.decided(GenerationScore(("code",), (11,), 48), prompts=10)
    assert not floor.decided(GenerationScore(("code", "chat"), (30, 20), 48), prompts=10)
    assert floor.decided(GenerationScore(("code",) * 3, (30, 20, 40), 48), prompts=10)
    drifting = GenerationScore(("code", "chat", "prose", "passkey"), (48, 30, 20, 48), 48)
    assert len(floor.reasons(drifting)) == 1 and "50%" in floor.reasons(drifting)[0]


def test_a_search_goes_on_while_the_floor_can_still_be_met_exactly_at_its_limits():
    floor = GenerationFloor()
    # every prompt so far matched whole: nothing is missed yet
    assert not floor.decided(GenerationScore(("code", "chat"), (48, 48), 48), prompts=4)
    # a divergence at token 16 is not early: only one before it is
    assert not floor.decided(GenerationScore(("code",), (16,), 48), prompts=10)
    assert floor.decided(GenerationScore(("code",), (15,), 48), prompts=10)
    # one miss of 4 still leaves exactly the 3/4 the floor asks for; two do not
    assert not floor.decided(GenerationScore(("code",), (30,), 48), prompts=4)
    assert floor.decided(GenerationScore(("code", "chat"), (30, 20), 48), prompts=4)


def test_bisection_finds_the_largest_passing_cut_and_checks_below_it():
    calls = []

    def below_19(cut):
        calls.append(cut)
        return cut < 19

    search = largest_passing_cut(below_19, 30)
    assert search.max_cut == 18 and search.monotone and calls[0] == 30
    assert len(calls) <= 9 and all(search.evaluated[c] == (c < 19) for c in calls)
    assert largest_passing_cut(lambda cut: True, 30).evaluated == {30: True, 10: True, 20: True}
    # a cut below the one bisection found fails: the max cut drops below it
    holes = largest_passing_cut(lambda cut: cut != 6 and cut <= 18, 30, verify=2)
    assert holes.monotone is False and holes.max_cut == 5
    # cut 0 quantizes nothing: never evaluated, even when the cut found is 1
    assert 0 not in largest_passing_cut(lambda cut: cut <= 1, 30).evaluated
    assert largest_passing_cut(lambda cut: False, 0).max_cut == 0
    assert largest_passing_cut(lambda cut: True, 1).max_cut == 1


def test_regating_lowers_a_failing_codecs_max_cut_and_marks_the_verdicts_above_it(
        smollm_bf16, tokenizer, monkeypatch):
    searched, search = [], generations.largest_passing_cut
    monkeypatch.setattr(generations, "largest_passing_cut",
                        lambda passes, high, *verify: searched.append(verify)
                        or search(passes, high, *verify))
    verdict = {"eligible": True, "reasons": [], "bf16_perplexity": 10.0}
    policy = Policy("smollm2-135m", (1, 2048), {"coarse": 30, "splitzip": 30},
                    verdicts=[{"codec": "coarse", "cut": 30, **verdict},
                              {"codec": "splitzip", "cut": 30, **verdict}])
    regated = regate_generations(smollm_bf16, policy, _prompts(tokenizer)[:1],
                                 GateConfig(generation_tokens=16),
                                 with_coarse(lambda name: deployed_codec(name, policy.meta)))
    assert regated.max_cut["splitzip"] == 30 and regated.max_cut["coarse"] < 30
    record = regated.meta.generation["codecs"]["coarse"]
    assert record["max_cut_before"] == 30 and record["max_cut"] == regated.max_cut["coarse"]
    assert all(e["passed"] for e in record["evaluated"] if e["cut"] <= record["max_cut"])
    assert not any(e["passed"] for e in record["evaluated"] if e["cut"] > record["max_cut"])
    # the search it ran: bisection, then one check below the cut found (`verify`'s default)
    assert searched == [(1,)] and "then 1 check(s) below" in regated.meta.generation["search"]
    # and what it judged by: the floor, the tokens generated, the prompts
    prompt = _prompts(tokenizer)[0]
    assert regated.meta.generation["floor"] == GateConfig(generation_tokens=16).floor.to_json()
    assert regated.meta.generation["tokens"] == 16
    assert regated.meta.generation["prompts"] == [{"kind": prompt.kind,
                                                   "tokens": len(prompt.ids)}]
    verdicts = {v["codec"]: v for v in regated.verdicts}
    assert verdicts["splitzip"]["eligible"] and verdicts["coarse"]["eligible"] is False
    assert "before token 16" in verdicts["coarse"]["reasons"][0]


def test_regating_prefills_its_references_with_the_window_its_codecs_rank_by(monkeypatch):
    """The references carry the token scores of the importance window of the codecs regated
    (`codecs`; None: every one) that have a cut: spectrum30's, and none for int8 alone."""
    windows = []

    class Stop(Exception):
        pass

    def references(model, prompts, tokens, importance_window=0):
        windows.append(importance_window)
        raise Stop

    monkeypatch.setattr(generations, "references", references)
    policy = Policy("smollm2-135m", (1, 2048), {"spectrum30": 30, "int8": 30, "int4": 0})
    for codecs in (None, ["int8"], ["spectrum30"], ["int4", "int8"]):
        with pytest.raises(Stop):
            regate_generations(None, policy, [], GateConfig(), get_codec, codecs=codecs)
    window = get_codec("spectrum30").importance_window
    assert window > 0 and windows == [window, 0, window, 0]


def test_regating_searches_each_lossy_codec_it_is_given_that_has_a_cut(monkeypatch):
    """Each codec of `codecs` that is lossy and has a max cut is searched, scored on the model's
    references with the gate's rebuild and floor, each step reported; the rest keep their max
    cut and get no record. The verdicts above the cut found turn ineligible, with the floor's
    reasons where that cut was scored; the others keep theirs. Scores here pass up to cut 12."""
    from rekv_core.plan import gate

    model, scored, said = object(), [], []
    refs = [SimpleNamespace(prompt=SimpleNamespace(kind="chat", ids=[1, 2, 3]))]
    config = GateConfig(generation_tokens=16)
    passing, failing = (GenerationScore(("chat",), (d,), 16) for d in (16, 0))

    def score(*args):
        scored.append(args)
        return passing if args[3] <= 12 else failing

    monkeypatch.setattr(generations, "references", lambda *args: refs)
    monkeypatch.setattr(generations, "score", score)
    verdicts = [{"codec": codec, "cut": cut, "eligible": eligible, "reasons": reasons}
                for codec, cut, eligible, reasons in [
                    ("int8", 12, True, []), ("int8", 13, True, []), ("int8", 20, True, []),
                    ("int8", 25, False, ["x"]), ("int4h", 30, True, [])]]
    policy = Policy("smollm2-135m", (1, 2048), {"int4": 0, "int8": 30, "splitzip": 30,
                                                "int4h": 30}, verdicts=verdicts)
    regated = regate_generations(model, policy, [], config, get_codec, progress=said.append,
                                 codecs=["int4", "int8", "splitzip"])
    assert regated.max_cut == {"int4": 0, "int8": 12, "splitzip": 30, "int4h": 30}
    assert (regated.model, regated.prompt_len_range, regated.epsilon) == (
        policy.model, policy.prompt_len_range, policy.epsilon)
    assert scored and all(args[0] is model and args[1] is refs and args[2].name == "int8"
                          and args[4] is gate.reconstructed_cache and args[5] == config.floor
                          for args in scored)
    cuts = [args[3] for args in scored]
    fails = "; ".join(config.floor.reasons(failing))
    assert fails and said == [f"int8 at cut {c}: " + ("passes" if c <= 12 else fails)
                              for c in cuts]
    record = regated.meta.generation
    assert set(record["codecs"]) == {"int8"}
    assert record["codecs"]["int8"] == {
        "max_cut_before": 30, "max_cut": 12, "monotone": True,
        "evaluated": [{"cut": c, "passed": c <= 12, **(passing if c <= 12 else failing).to_json()}
                      for c in sorted(cuts)]}
    assert (record["tokens"], record["prompts"]) == (16, [{"kind": "chat", "tokens": 3}])
    assert regated.verdicts == [
        {**verdicts[0], **passing.to_json()},
        {**verdicts[1], **failing.to_json(), "eligible": False,
         "reasons": config.floor.reasons(failing)},
        {**verdicts[2], "eligible": False,
         "reasons": ["above cut 12, the largest whose generations meet the floor"]},
        verdicts[3], verdicts[4]]


def test_the_calibration_set_holds_code_chat_prose_and_a_passkey(tokenizer):
    ids = tokenizer.encode(TEXT)
    prompts = generation_prompts(tokenizer, ids, prose=1, prose_len=64, passkey_len=300)
    kinds = [p.kind for p in prompts]
    assert kinds.count("code") == len(CODE) and kinds.count("chat") == len(CHAT)
    assert kinds.count("prose") == 1 and kinds.count("passkey") == 1
    prose = next(p for p in prompts if p.kind == "prose")
    assert len(prose.ids) == 64 and list(prose.ids) == ids[len(ids) // 2:][:64]
    assert 200 < len(prompts[-1].ids) <= 300


def test_runs_on_different_codecs_combine_into_one_policy():
    from rekv_core.plan.gate import combine_regates

    verdict = {"eligible": True, "reasons": []}
    base = Policy("smollm2-135m", (1, 2048), {"int8": 30, "int4h": 30, "splitzip": 30},
                  verdicts=[{"codec": c, "cut": 30, **verdict} for c in ("int8", "int4h")])

    def run(codec, max_cut):
        record = {"tokens": 48, "codecs": {codec: {"max_cut": max_cut}}}
        verdicts = [{**v, "eligible": False, "reasons": ["x"]} if v["codec"] == codec else v
                    for v in base.verdicts]
        return Policy(base.model, base.prompt_len_range, {**base.max_cut, codec: max_cut},
                      verdicts=verdicts, meta={"generation": record})

    combined = combine_regates(base, [run("int8", 4), run("int4h", 9)])
    assert combined.max_cut == {"int8": 4, "int4h": 9, "splitzip": 30}
    assert not any(v["eligible"] for v in combined.verdicts)
    assert set(combined.meta.generation["codecs"]) == {"int8", "int4h"}
    # one record: every codec judged, and each run's settings without its codecs
    assert combined.meta.generation == {"tokens": 48,
                                        "codecs": {"int8": {"max_cut": 4}, "int4h": {"max_cut": 9}},
                                        "runs": [{"tokens": 48}, {"tokens": 48}]}
    assert (combined.model, combined.prompt_len_range, combined.epsilon) == (
        base.model, base.prompt_len_range, base.epsilon)
    with pytest.raises(ValueError, match=r"more than one judged \['int8'\]$"):
        combine_regates(base, [run("int8", 4), run("int4h", 9), run("int8", 5)])
