"""The cost model and the estimates that feed it (the link, the layer cost, the EWMA)."""

import dataclasses

import pytest

from rekv_core.handoff import Action, Order
from rekv_core.handoff.action import wire_bytes
from rekv_core.model.shapes import get_preset
from rekv_core.plan import CostInputs, choose, predict
from rekv_core.plan.calibration import codec_costs
from rekv_core.plan.cost import Prediction
from rekv_core.plan.estimates import Ewma, LayerCost, LinkEstimate

SHAPE = get_preset("smollm2-135m")
L = SHAPE.num_layers
LAYERS, TOKENS, EITHER = frozenset({Order.LAYERS}), frozenset({Order.TOKENS}), frozenset(Order)


def _inputs(gbps, gamma=2.0, S=2048):
    return CostInputs(SHAPE, S, gbps, gamma, codec_costs({"bf16": 0.0, "int8": 0.5},
                                                         {"bf16": 0.01, "int8": 0.01}), 1.0)


def test_prediction_follows_the_byte_model_and_eq9():
    inputs = _inputs(1.0)
    full = predict(Action.full_bf16(L), inputs)
    bytes_per_ms = 1e9 / 8 / 1e3
    assert full.bytes == wire_bytes(Action.full_bf16(L), SHAPE, 2048).total
    assert full.r_ms == 0 and full.total_ms == pytest.approx(full.x_ms + full.h_ms + 1.0)
    assert full.x_ms >= full.bytes / bytes_per_ms
    token = predict(Action.token_only(L), inputs)
    assert token.r_ms == L * 2.0 and token.x_ms == 0
    joint = predict(Action("int8", 20, L), inputs)
    assert joint.r_ms == 10 * 2.0
    assert joint.total_ms == pytest.approx(joint.h_ms + max(joint.x_ms, joint.r_ms) + 1.0)


def test_choice_moves_with_the_link():
    fast = choose(_inputs(400.0), ["bf16", "int8"])[0].action
    assert fast.kind.value in ("bf16_transfer", "quant_transfer")
    slow = choose(_inputs(0.05), ["bf16", "int8"])[0].action
    assert slow.kind.value == "token_recompute"  # cheap compute, a slow link
    # all BF16 KV (47 MiB) takes about as long on the link as all layers take to compute
    middle = choose(_inputs(0.4, gamma=30.0), ["bf16", "int8"])
    assert middle[0].action.kind.value == "joint"
    assert [p.total_ms for p in middle] == sorted(p.total_ms for p in middle)


def test_link_estimate_moves_with_observed_transfers():
    link = LinkEstimate(min_bytes=1000)
    assert link.gbps is None and not link.measured and link.or_prior(10.0) == 10.0
    link.observe(500, 1.0)  # too small to say anything about the rate
    assert link.gbps is None and not link.measured
    link.observe(125_000_000, 1.0)  # 1 Gb/s
    assert link.gbps == pytest.approx(1.0) and link.measured
    assert link.or_prior(10.0) == pytest.approx(1.0)
    for _ in range(10):
        link.observe(250_000_000, 1.0)
    assert link.gbps == pytest.approx(2.0)
    link.observe(250_000_000, 0.1)  # one disturbed sample (20 Gb/s) does not move it
    assert link.gbps == pytest.approx(2.0)
    assert link.observe(250_000_000, 0.0) == pytest.approx(2.0)  # no time measured: no sample
    for _ in range(4):  # a real change does, within half the window
        link.observe(125_000_000, 1.0)
    assert link.gbps == pytest.approx(1.5)
    link.observe(125_000_000, 1.0)
    assert link.gbps == pytest.approx(1.0)


def test_an_ewma_takes_its_first_sample_whole_then_weighs_each_in():
    ewma = Ewma(1.0, weight=0.25)
    assert ewma.value == 1.0 and ewma.samples == 0  # the prior, until something is seen
    assert ewma.update(8.0) == 8.0  # the first sample replaces the prior
    assert ewma.update(4.0) == pytest.approx(0.25 * 4.0 + 0.75 * 8.0)
    assert ewma.update(2.0) == pytest.approx(0.25 * 2.0 + 0.75 * 7.0)
    assert ewma.value == pytest.approx(5.75) and ewma.samples == 3


def test_layer_cost_interpolates_and_grows_beyond_the_profile():
    cost = LayerCost([64, 256, 1024], [1.0, 2.0, 12.0])
    assert cost.at(10) == 1.0 and cost.at(160) == pytest.approx(1.5)
    assert cost.at(2048) > 2 * cost.at(1024)  # the last segment grew faster than linearly
    with pytest.raises(ValueError):
        LayerCost([], [])


def test_per_message_cost_favours_fewer_messages():
    base = _inputs(10.0, gamma=2.0, S=256)
    costly = CostInputs(SHAPE, 256, 10.0, 2.0, codec_costs({"bf16": 0.0, "int8": 0.5},
                                                           {"bf16": 0.01, "int8": 0.01}), 1.0,
                        message_ms=3.0)
    joint = Action("int8", 20, L)
    assert predict(joint, costly).x_ms == pytest.approx(predict(joint, base).x_ms + 20 * 3.0)
    assert predict(joint, costly).h_ms == pytest.approx(predict(joint, base).h_ms + 3.0)
    # with a 3 ms cost per message, recomputing 30 cheap layers beats sending 30 messages
    assert choose(costly, ["bf16", "int8"])[0].action.cut < choose(base, ["bf16", "int8"])[
        0].action.cut


def test_restore_is_charged_per_codec():
    """Each codec's prefix pays its own restore cost, not the slowest codec's."""
    cheap_int4 = CostInputs(SHAPE, 2048, 1.0, 2.0, codec_costs({"int8": 0.5, "int4": 0.5},
                                                               {"int8": 2.0, "int4": 0.1}), 1.0)
    layer_mib = SHAPE.kv_layer_bytes(2048) / 2**20
    free = dataclasses.replace(cheap_int4, codec_costs=codec_costs({"int8": 0.5, "int4": 0.5},
                                                                   {}))
    for codec, per_mib in (("int8", 2.0), ("int4", 0.1)):
        action = Action(codec, 12, L)
        extra = predict(action, cheap_int4).x_ms - predict(action, free).x_ms
        assert extra == pytest.approx(per_mib * layer_mib * 12)


def _streamed(gbps, gamma=2.0, gamma_p=2.0, S=2048, chunk=0, **kwargs):
    return dataclasses.replace(_inputs(gbps, gamma, S), prefill_ms_per_layer=gamma_p,
                               streamed=True, chunk_tokens=chunk, **kwargs)


def test_streamed_prediction_counts_only_the_layers_below_the_cut():
    inputs = _streamed(1.0)
    token = predict(Action.token_only(L), inputs)
    assert token.prefill_ms == 0 and token.total_ms == pytest.approx(token.h_ms + L * 2.0 + 1.0)
    joint = predict(Action("int8", 10, L), inputs)
    assert joint.prefill_ms == 10 * 2.0 and joint.r_ms == 20 * 2.0
    # the prefill of c layers, the boundary, then the suffix, then the join
    assert joint.total_ms >= 10 * 2.0 + joint.r_ms + 1.0
    seed = predict(Action("int8", 10, L), dataclasses.replace(inputs, streamed=False))
    assert seed.prefill_ms == L * 2.0


@pytest.mark.parametrize("gbps", [0.05, 0.4, 1.0, 10.0, 400.0])
def test_streaming_never_predicts_worse_than_the_seeds_schedule(gbps):
    streamed, seed = _streamed(gbps), dataclasses.replace(_streamed(gbps), streamed=False)
    for action in [Action.token_only(L), Action.full_bf16(L), Action("int8", L, L)] + [
            Action(codec, c, L) for codec in ("bf16", "int8") for c in (1, 10, 20, 29)]:
        assert predict(action, streamed).total_ms <= predict(action, seed).total_ms + 1e-9


def test_a_chunked_boundary_takes_the_boundary_off_the_critical_path():
    # a slow link, where the whole boundary's wire time is long beside one chunk's
    action = Action("int8", 10, L)
    whole = predict(action, _streamed(0.4))
    chunked = predict(action, _streamed(0.4, chunk=256))
    boundary_ms = 2048 * SHAPE.hidden_size * 2 / (0.4e9 / 8 / 1e3)
    # the first chunk lands 7/8 of the boundary's wire time earlier, and the suffix starts then
    assert whole.h_ms - chunked.h_ms == pytest.approx(boundary_ms * 7 / 8, rel=0.01)
    assert chunked.total_ms < whole.total_ms


def test_a_streamed_boundary_follows_the_prefix_on_the_link():
    """Streamed, the link carries each prefix layer as the prefill produces it, then the
    boundary's chunks: the first chunk lands one chunk's wire time after the later of the cut and
    the prefix's arrival, and the suffix starts on it."""
    S = 2048
    per_layer_mib = SHAPE.kv_layer_bytes(S) / 2**20
    alpha, restore = 0.5 * per_layer_mib, 0.01 * per_layer_mib
    layer = wire_bytes(Action("int8", 1, L), SHAPE, S)
    for gbps, c, gamma_p, bound in ((0.4, 10, 2.0, "link"), (400.0, 10, 30.0, "compute"),
                                    (0.4, 1, 2.0, "link")):
        per_ms = gbps * 1e9 / 8 / 1e3
        step, w = gamma_p + alpha, (layer.prefix + layer.scales) / per_ms
        prefix_end = max(c * step + w, step + c * w)
        first = max(c * step, prefix_end) + 256 * SHAPE.hidden_size * 2 / per_ms
        joint = predict(Action("int8", c, L), _streamed(gbps, chunk=256, S=S, gamma_p=gamma_p))
        assert joint.h_ms == pytest.approx(first), bound
        assert joint.x_ms == pytest.approx(max(0.0, prefix_end + restore - first)), bound


def test_a_streamed_link_sample_counts_the_prefix_ahead_of_the_first_chunk():
    """What lands back to back before the suffix starts: streamed, the prefix then the first
    chunk; after a full prefill, the first chunk alone (it goes first)."""
    from rekv_core.plan import planner as plan

    S = 200  # one chunk
    streamed = _streamed(1.0, S=S, chunk=256)
    first_chunk = S * SHAPE.hidden_size * 2
    assert first_chunk < plan.LINK_SAMPLE_BYTES  # so the layers ahead of it decide
    assert plan.samples_link(Action("bf16", 1, L), streamed)  # layer 0, then the chunk
    # pipelined, the chunk goes first and the suffix starts on it
    assert not plan.samples_link(Action("bf16", 1, L), streamed, pipelined=True)
    assert not plan.samples_link(Action("bf16", 1, L), dataclasses.replace(streamed,
                                                                           streamed=False))


def _ranked_first(inputs, codecs=("int8",)):
    return min(choose(inputs, list(codecs)), key=lambda p: p.total_ms + p.load_ms)


def test_the_reported_backlogs_move_the_work_to_the_idle_pool():
    inputs = _streamed(10.0, gamma=20.0, gamma_p=20.0)
    busy_prefill = _ranked_first(dataclasses.replace(inputs, prefill_queue=2,
                                                     prefill_wait_ms=1500.0))
    busy_decode = _ranked_first(dataclasses.replace(inputs, decode_queue=2,
                                                    decode_wait_ms=1500.0))
    assert busy_prefill.action.cut < L // 2 < busy_decode.action.cut
    # the load term: the others in flight wait for this request's longer stage
    assert busy_prefill.load_ms == 2 * max(busy_prefill.prefill_ms, busy_prefill.r_ms)


def test_under_load_the_cut_settles_between_the_ends():
    """Equal pools, three other requests in flight and no backlog on either side: the stages
    balance (the throughput run's best forced cut is L/2 for this reason); idle, T alone picks."""
    inputs = _streamed(10.0, gamma=20.0, gamma_p=20.0)
    loaded = _ranked_first(dataclasses.replace(inputs, prefill_queue=2, decode_queue=1))
    assert abs(loaded.action.cut - L / 2) <= 2
    idle = _ranked_first(inputs)
    assert idle.load_ms == 0.0
    assert idle.total_ms <= loaded.total_ms + 1e-9


def test_a_decode_backlog_delays_the_decode_side_compute_only():
    quiet, backlog = _streamed(10.0, gamma=20.0), _streamed(10.0, gamma=20.0,
                                                            decode_wait_ms=900.0)
    token = Action.token_only(L)
    assert predict(token, backlog).total_ms == pytest.approx(
        max(predict(token, quiet).h_ms, 900.0) + L * 20.0 + 1.0)
    joint = Action("int8", 10, L)
    assert predict(joint, backlog).total_ms >= 900.0 + 20 * 20.0
    transfer = Action("int8", L, L)  # nothing to compute on the decode side
    assert predict(transfer, backlog).total_ms == pytest.approx(predict(transfer, quiet).total_ms)
    seed = dataclasses.replace(_inputs(10.0, gamma=20.0), prefill_ms_per_layer=20.0,
                               decode_wait_ms=5000.0)
    assert predict(joint, seed).total_ms >= 5000.0 + 20 * 20.0


def test_a_prefill_backlog_moves_the_cut_down_and_a_busy_decode_moves_it_up():
    def best(**kwargs):
        inputs = _streamed(10.0, gamma=20.0, gamma_p=20.0, **kwargs)
        return min(choose(inputs, ["bf16"]), key=lambda p: p.total_ms + p.load_ms).action.cut

    # a decode worker sharing its compute four ways leaves the layers to an idle prefill
    busy_decode = _streamed(10.0, gamma=80.0, gamma_p=20.0)
    assert min(choose(busy_decode, ["bf16"]), key=lambda p: p.total_ms).action.cut == L
    # a prefill worker with 600 ms of compute queued ahead: the decode side takes more layers,
    # and token-only waits for nothing
    backlog = best(prefill_wait_ms=600.0)
    assert backlog < L
    token = predict(Action.token_only(L), _streamed(10.0, gamma=20.0, prefill_wait_ms=600.0))
    assert token.total_ms == pytest.approx(predict(Action.token_only(L), _streamed(
        10.0, gamma=20.0)).total_ms)
    joint = Action("bf16", 15, L)
    waited = predict(joint, _streamed(10.0, gamma=20.0, prefill_wait_ms=600.0))
    assert waited.total_ms >= predict(joint, _streamed(10.0, gamma=20.0)).total_ms + 599


def test_a_pipelined_prefill_shares_the_prompt_between_the_two_workers():
    """Token order on a free link with free codecs: the prefill's c layers and the decode side's
    L − c run on different chunks at once, so with n chunks and equal halves the critical path is
    (n + 1) chunk-halves, (n + 1)/(2n) of the layer order's L·γ."""
    free = dataclasses.replace(_streamed(1e6, chunk=256), codec_costs={}, orders=TOKENS)
    action = Action("bf16", L // 2, L)
    tokens = predict(action, free)
    layers = predict(action, dataclasses.replace(free, orders=LAYERS))
    assert tokens.pipelined and not layers.pipelined
    n = 2048 // 256
    half_chunk = (L // 2) * 2.0 / n
    assert tokens.total_ms == pytest.approx((n + 1) * half_chunk + 1.0, rel=1e-3)
    assert layers.total_ms == pytest.approx(L * 2.0 + 1.0, rel=0.02)
    assert tokens.prefill_ms == layers.prefill_ms and tokens.r_ms == layers.r_ms


def test_the_order_goes_to_the_lesser_prediction_where_it_applies():
    for gbps in (0.05, 0.4, 10.0):
        either = _streamed(gbps, chunk=256, orders=EITHER)
        for action in [Action("int8", c, L) for c in (1, 10, 20, 29)] + [Action("bf16", 15, L)]:
            best = predict(action, either)
            tokens = predict(action, dataclasses.replace(either, orders=TOKENS))
            layers = predict(action, dataclasses.replace(either, orders=LAYERS))
            assert best.total_ms == min(tokens.total_ms, layers.total_ms)
            assert best.pipelined == (tokens.total_ms < layers.total_ms)
    tokens = _streamed(10.0, chunk=256, orders=TOKENS)
    for action in (Action.token_only(L), Action("int8", L, L), Action("spectrum30", 10, L)):
        assert not predict(action, tokens).pipelined  # not pipelinable: layer order
    assert not predict(Action("int8", 10, L), _streamed(10.0, chunk=0, orders=TOKENS)).pipelined
    with pytest.raises(ValueError, match="orders"):
        _streamed(1.0, orders=frozenset({"sideways"}))
    with pytest.raises(ValueError, match="orders"):
        _streamed(1.0, orders=frozenset())


def test_a_slow_link_keeps_the_pipelined_prefix_on_the_critical_path():
    """Token order sends every prefix row after its chunk's boundary rows: on a link slower
    than the compute the prefix ends last, as it does in layer order."""
    tokens = predict(Action("bf16", 10, L), _streamed(0.05, chunk=256, orders=TOKENS))
    prefix_ms = wire_bytes(Action("bf16", 10, L), SHAPE, 2048).total / (0.05e9 / 8 / 1e3)
    assert tokens.total_ms >= prefix_ms


def test_the_planner_says_when_it_pipelines():
    from rekv_core.plan.planner import Planner

    fast = _streamed(10.0, chunk=256, orders=EITHER)
    decision = Planner().decide(fast, ["bf16", "int8"])
    assert decision.pipelined and 0 < decision.action.cut < L
    assert decision.as_dict()["chosen"]["pipelined"] is True
    forced = Planner().decide(fast, ["bf16"], forced=Action("bf16", L, L))
    assert not forced.pipelined
    layers = Planner().decide(dataclasses.replace(fast, orders=LAYERS), ["bf16", "int8"])
    assert not layers.pipelined


def test_a_prediction_reads_as_the_dict_the_services_and_the_cli_print():
    split = Prediction(Action("int8", 12, L, split=256), total_ms=10.5, h_ms=1.0, x_ms=2.0,
                       r_ms=3.0, j_ms=0.5, bytes=1234, prefill_ms=4.0, load_ms=0.25,
                       pipelined=True)
    assert split.as_dict() == {
        "action": "token_split", "codec": "int8", "cut": 12, "split": 256, "predicted_ms": 10.5,
        "h_ms": 1.0, "x_ms": 2.0, "r_ms": 3.0, "j_ms": 0.5, "bytes": 1234, "prefill_ms": 4.0,
        "load_ms": 0.25, "pipelined": True, "progressive": False, "layer_split": 0}
    lynx = Prediction(Action("int8", L, L, progressive=True), 7.0, 0.0, 6.0, 0.0, 1.0, 99)
    assert lynx.as_dict() == {
        "action": "quant_transfer", "codec": "int8", "cut": L, "split": 0, "predicted_ms": 7.0,
        "h_ms": 0.0, "x_ms": 6.0, "r_ms": 0.0, "j_ms": 1.0, "bytes": 99, "prefill_ms": 0.0,
        "load_ms": 0.0, "pipelined": False, "progressive": True, "layer_split": 0}
    per_layer = Prediction(Action("int4", 20, L, layer_split=512), 1.0, 0.0, 0.0, 0.0, 0.0, 1)
    assert per_layer.as_dict()["action"] == "joint"
    assert per_layer.as_dict()["layer_split"] == 512


def test_a_decision_reads_as_its_choice_its_rule_and_every_candidate():
    from rekv_core.plan.planner import Planner

    decision = Planner().decide(_streamed(10.0, chunk=256, orders=EITHER), ["bf16", "int8"])
    out = decision.as_dict()
    action = decision.action
    assert out["chosen"] == {"action": action.kind.value, "codec": action.codec,
                             "cut": action.cut, "split": action.split, "layer_split": 0,
                             "predicted_ms": decision.predicted_ms, "pipelined": True}
    assert out["rule"] == decision.rule.value == "best"
    assert len(out["candidates"]) == len(decision.candidates) > 1
    for listed, (prediction, ms) in zip(out["candidates"], decision.candidates):
        assert listed == {**prediction.as_dict(), "model_ms": prediction.total_ms,
                          "predicted_ms": ms}
