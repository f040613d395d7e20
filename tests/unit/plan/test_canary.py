"""The canary's check against a recomputed reference, its window and the gate's threshold."""

import pytest
import torch

from rekv_core.eval.needle import passkey_prompt
from rekv_core.handoff import Action
from rekv_core.model import KVCache, prefill
from rekv_core.plan.canary import (CONFIDENCE_Z, GATE_FIGURE, GATE_TOP1_AGREEMENT,
                                   AgreementWindow, CanaryJudge, CanaryResult,
                                   agreement_threshold, canary_steps, upper_bound)
from rekv_core.plan.policy import Policy, shipped_policy
from services.prefill.faults import coarsened

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"


def _run(steps) -> tuple[int, object]:
    count = 0
    while True:
        try:
            next(steps)
            count += 1
        except StopIteration as done:
            return count, done.value


def _handed(model, ids, extra: int, damage=None):
    """The cache and first logits a handoff would give; `damage(layer, t)` changes layers."""
    out = prefill(model, ids, boundaries=())
    keys, values = list(out.keys), list(out.values)
    if damage is not None:
        keys = [damage(i, k) for i, k in enumerate(keys)]
        values = [damage(i, v) for i, v in enumerate(values)]
    return KVCache.from_layers(keys, values, len(ids) + extra), out.logits


# The reference decodes step by step, the checked cache extends in one pass: the same sums in
# other orders. In float32 that changes the KL by float32 rounding, far below this bound and
# orders of magnitude below a broken cache's on every CPU; in BF16 the noise depends on the CPU's
# kernels (up to 1e-3 seen), so BF16 is held to the top-1 verdict alone.
FLOAT32_EXACT_KL = 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_exact_cache_agrees_everywhere(dtype, smollm_fp32, smollm_bf16, tokenizer):
    model = smollm_fp32 if dtype == "float32" else smollm_bf16
    ids = tokenizer.encode(PROMPT)
    cache, logits = _handed(model, ids, extra=12)
    cache.length += 5  # the request decoded from it: the check starts again at the prompt's end
    count, result = _run(canary_steps(model, ids, cache, logits, continuation=6))
    assert result.agrees and result.first_token_agrees
    assert (result.agreeing, result.positions) == (8, 8)  # first token, first decoded, 6 more
    if dtype == "float32":
        assert 0.0 <= result.kl < FLOAT32_EXACT_KL
    # one step per layer of each chunk, then the decode steps: a caller can stop between them
    assert count == model.shape.num_layers + 7


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_broken_prefix_is_flagged(dtype, smollm_fp32, smollm_bf16, tokenizer):
    model = smollm_fp32 if dtype == "float32" else smollm_bf16
    ids = tokenizer.encode(passkey_prompt(31415, 3, 0.5))
    cut = 29

    def damage(layer, t):  # the prefix layers at five levels: `coarse_codec`'s damage
        return coarsened(t) if layer < cut else t

    cache, logits = _handed(model, ids, extra=8, damage=damage)
    _, result = _run(canary_steps(model, ids, cache, logits, continuation=7))
    assert result.first_token_agrees  # the first token came from the exact suffix
    assert not result.agrees and result.agreement < 1.0
    healthy, logits = _handed(model, ids, extra=8)
    _, exact = _run(canary_steps(model, ids, healthy, logits, continuation=7))
    assert exact.agrees and exact.first_token_agrees
    if dtype == "float32":  # the broken cache's KL against the same machine's exact one
        assert exact.kl < FLOAT32_EXACT_KL and result.kl > 1e3 * FLOAT32_EXACT_KL


def test_the_continuation_fits_the_cache_and_can_be_off(smollm_bf16, tokenizer):
    ids = tokenizer.encode(PROMPT)
    cache, logits = _handed(smollm_bf16, ids, extra=3)
    _, result = _run(canary_steps(smollm_bf16, ids, cache, logits, continuation=10))
    assert result.agrees and result.positions == 1 + 3  # as far as the cache has room
    cache, logits = _handed(smollm_bf16, ids, extra=3)
    _, result = _run(canary_steps(smollm_bf16, ids, cache, logits, continuation=0))
    assert result.positions == 2  # the first token and the first decoded position
    with pytest.raises(ValueError, match="lossy"):
        next(canary_steps(smollm_bf16, ids + ids, cache, logits, continuation=4))


def _check(agreeing: int, positions: int = 10, kl: float = 0.0) -> CanaryResult:
    return CanaryResult(True, agreeing, positions, kl)


def test_the_window_is_judged_once_full_and_reports_each_crossing():
    window = AgreementWindow(3, threshold=0.99)
    assert window.add(_check(10)) is None and window.add(_check(2, kl=0.3)) is None  # not full
    dropped = window.add(_check(10))
    assert dropped is not None and dropped.below
    assert dropped.agreement == pytest.approx(22 / 30) and dropped.mean_kl == pytest.approx(0.1)
    assert window.add(_check(3)) is None  # still below: said once
    assert window.add(_check(10)) is None and window.add(_check(10)) is None  # 3 of 30 differ
    recovered = window.add(_check(10))
    assert recovered is not None and not recovered.below and recovered.agreement == 1.0
    with pytest.raises(ValueError, match="size"):
        AgreementWindow(0, 1.0)


def test_a_rare_disagreement_at_the_gates_rate_is_not_a_drop():
    # the gate measured 0.997 for int8: one position in 200 differing is within that
    window = AgreementWindow(20, threshold=0.997)
    changes = [window.add(_check(9 if i == 7 else 10)) for i in range(20)]
    assert changes == [None] * 20 and window.agreement == pytest.approx(199 / 200)
    assert upper_bound(199, 200) > 0.997 > upper_bound(190, 200)
    assert upper_bound(5, 5) == pytest.approx(1.0) and upper_bound(0, 5) < 0.5


def test_the_bound_is_wilsons_and_never_above_one():
    z2 = CONFIDENCE_Z * CONFIDENCE_Z
    # none of n agreeing: Wilson's upper bound is z^2 / (n + z^2)
    assert upper_bound(0, 5) == pytest.approx(z2 / (5 + z2), rel=1e-12)
    assert upper_bound(0, 200) == pytest.approx(z2 / (200 + z2), rel=1e-12)
    # all agreeing: exactly 1, whatever the float rounding (the formula gives 1 - 2^-53 at n = 5)
    assert all(upper_bound(n, n) == 1.0 for n in range(1, 400))


def test_a_window_of_exact_checks_is_never_a_drop_whatever_their_positions():
    """At threshold 1.0 every count of agreeing positions holds, not only the ones whose bound
    happens to round to 1 (5 of 5 did not)."""
    for positions in range(1, 60):
        window = AgreementWindow(1, threshold=GATE_TOP1_AGREEMENT)
        assert window.add(_check(positions, positions)) is None, positions


def test_a_window_that_agrees_everywhere_is_not_a_drop_at_the_gates_criterion():
    # threshold 1.0 (a lossless verdict, or no policy): a full window of exact checks, here 20
    # positions, whose upper bound is 1.0, holds
    window = AgreementWindow(2, threshold=GATE_TOP1_AGREEMENT)
    assert window.add(_check(10)) is None and window.add(_check(10)) is None
    assert window.add(_check(9)) is not None  # one disagreement is


def test_the_threshold_is_what_the_gate_measured():
    policy = shipped_policy("smollm2-135m")
    layers = 30
    figure = {(v["codec"], v["cut"]): v["continuation_top1_agreement"] for v in policy.verdicts}
    assert agreement_threshold(policy, Action("int8", 20, layers)) == figure["int8", 24]
    assert agreement_threshold(policy, Action("int4", 6, layers)) == figure["int4", 6] < 1.0
    assert agreement_threshold(policy, Action("splitzip", 3, layers)) == 1.0
    assert agreement_threshold(None, Action("int4", 6, layers)) == GATE_TOP1_AGREEMENT == 1.0


def test_a_verdict_without_a_cut_sets_no_threshold():
    # an older writer's verdict that names no cut vouches for no cut: the gate's criterion holds
    policy = Policy("smollm2-135m", (1, 2048), {"int4": 30},
                    verdicts=[{"codec": "int4", GATE_FIGURE: 0.5},
                              {"codec": "int4", "cut": 12, GATE_FIGURE: 0.9}])
    assert agreement_threshold(policy, Action("int4", 1, 30)) == 0.9
    assert agreement_threshold(policy, Action("int4", 18, 30)) == GATE_TOP1_AGREEMENT


def test_the_judge_keeps_a_window_per_action_under_the_models_policy(tmp_path):
    judge = CanaryJudge.for_model("smollm2-135m", "", window=1)
    int4, int8 = Action("int4", 6, 30), Action("int8", 6, 30)
    window, change = judge.add(int4, CanaryResult(True, 99, 100, 0.01))
    assert window.threshold == agreement_threshold(judge.policy, int4) < 1.0
    assert change is None  # 0.99 is within what the gate measured for int4 at cut 6
    window, change = judge.add(int8, CanaryResult(True, 50, 100, 0.5))
    assert change is not None and change.below
    assert window.threshold == agreement_threshold(judge.policy, int8)  # its own window
    assert agreement_threshold(judge.policy, int8) != agreement_threshold(judge.policy, int4)
    assert judge.add(int4, CanaryResult(True, 100, 100, 0.0))[0] is not window
    other = shipped_policy("smollm2-135m")
    other.model = "qwen2.5-7b"
    other.save(tmp_path / "policy.json")
    with pytest.raises(ValueError, match="policy: written for qwen2.5-7b"):
        CanaryJudge.for_model("smollm2-135m", str(tmp_path / "policy.json"), window=1)
    with pytest.raises(ValueError, match=r"window: must be >= 1, got 0"):
        CanaryJudge(None, window=0)


def test_a_cache_without_the_prompt_and_one_more_row_is_refused_by_name(smollm_fp32, tokenizer):
    """The check needs the prompt's positions and room for one more: a cache of exactly that is
    checked (one position past the first), one row short or one position short is refused."""
    ids = tokenizer.encode(PROMPT)
    cache, logits = _handed(smollm_fp32, ids, extra=1)
    _, result = _run(canary_steps(smollm_fp32, ids, cache, logits, continuation=5))
    assert result.positions == 2 and result.agrees
    tight, _ = _handed(smollm_fp32, ids, extra=0)
    with pytest.raises(ValueError, match=f"lossy: holds {len(ids)} of {len(ids)} prompt positions "
                                         f"with room to {len(ids)}"):
        _run(canary_steps(smollm_fp32, ids, tight, logits, continuation=5))
    short, _ = _handed(smollm_fp32, ids, extra=4)
    short.length = len(ids) - 1
    with pytest.raises(ValueError, match=f"holds {len(ids) - 1} of {len(ids)}"):
        _run(canary_steps(smollm_fp32, ids, short, logits, continuation=5))
