"""The quality setting: under `lossless` the planner keeps to actions that reproduce the reference
bit for bit, whatever the link, the evidence or the unmeasured link's choice; `gated` also takes
what the policy passed; the decode worker offers only lossless codecs under `lossless`."""

import pytest

from rekv_core.codecs import codec_names, get_codec
from rekv_core.handoff import Action
from rekv_core.model.shapes import get_preset
from rekv_core.plan import CostInputs
from rekv_core.plan.calibration import codec_costs
from rekv_core.plan.evidence import Evidence, Measured
from rekv_core.plan.planner import Planner
from rekv_core.plan.policy import Policy
from rekv_core.plan.quality import Quality, offered_codecs

SHAPE = get_preset("smollm2-135m")
CODECS = ["bf16", "int8", "int4h", "splitzip"]
ALL_CUTS = {"int8": 30, "int4h": 30, "splitzip": 30}


def _inputs(gbps: float, measured: bool = True) -> CostInputs:
    costs = {"bf16": 0.0, "int8": 0.5, "int4h": 0.6, "splitzip": 2.0}
    return CostInputs(SHAPE, 2048, gbps, 30.0, codec_costs(costs, costs), 1.0,
                      link_measured=measured)


@pytest.mark.parametrize("gbps", [0.01, 0.1, 1.0, 10.0, 100.0])
@pytest.mark.parametrize("measured", [True, False])
def test_lossless_never_picks_a_lossy_codec_whatever_the_link(gbps, measured):
    policy = Policy("smollm2-135m", (1, 4096), ALL_CUTS)
    # lossy actions measured much faster than anything else must not tempt it either
    evidence = Evidence(measured={Action("int4h", 29, 30): Measured(0.5, 2048, 5)})
    decision = Planner(policy, explore_every=1).decide(_inputs(gbps, measured), CODECS,
                                                       evidence, quality=Quality.LOSSLESS)
    assert decision.action.lossless
    assert all(p.action.lossless for p, _ in decision.candidates)
    assert {p.action.codec for p, _ in decision.candidates if p.action.cut} >= {"bf16"}


def test_gated_takes_a_lossy_action_the_policy_passed_where_it_is_cheaper():
    policy = Policy("smollm2-135m", (1, 4096), ALL_CUTS)
    gated = Planner(policy).decide(_inputs(1.0), CODECS, quality=Quality.GATED)
    assert not gated.action.lossless
    lossless = Planner(policy).decide(_inputs(1.0), CODECS, quality=Quality.LOSSLESS)
    assert lossless.action.lossless and lossless.predicted_ms > gated.predicted_ms


def test_gated_admits_the_lossy_actions_the_policy_passed_and_no_others():
    """Each lossy codec at every cut up to its verdict's, Lynx's stream of a passed `int8` action
    too; none beyond, none of a codec the policy failed, none outside its prompt lengths, and none
    under `lossless`."""
    planner = Planner(Policy("smollm2-135m", (1, 4096), {"int8": 12, "int4h": 30, "int4": 0}))
    for codec, passed in (("int8", 12), ("int4h", 30), ("int4", 0), ("spectrum50", 0)):
        for cut in range(1, 31):
            action = Action(codec, cut, 30)
            assert planner.allowed(action, 2048, Quality.GATED) == (cut <= passed), action
            assert not planner.allowed(action, 2048, Quality.LOSSLESS), action
    assert planner.allowed(Action("int8", 12, 30, progressive=True), 2048, Quality.GATED)
    assert not planner.allowed(Action("int8", 12, 30), 4097, Quality.GATED)
    assert not Planner(None).allowed(Action("int8", 12, 30), 2048, Quality.GATED)


def test_lossless_allows_exactly_the_actions_that_reproduce_the_reference():
    lossy = [c for c in codec_names() if not get_codec(c).lossless]
    assert set(lossy) >= {"int8", "int4", "int4h", "spectrum30", "spectrum50"}
    assert not any(Quality.LOSSLESS.allows(Action(c, 15, 30)) for c in lossy)
    for action in (Action("bf16", 15, 30), Action("splitzip", 30, 30),
                   Action("splitzip", 12, 30, "splitzip"), Action.token_only(30)):
        assert Quality.LOSSLESS.allows(action) and Quality.GATED.allows(action)
    assert offered_codecs(Quality.LOSSLESS, codec_names()) == ("bf16", "splitzip")
    assert offered_codecs(Quality.GATED, ("int8", "bf16")) == ("int8", "bf16")
