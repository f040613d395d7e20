"""The connectors (`rekv_core.connector`) without a server: the decode side's offer, begin,
receive, reply check and learning, and the prefill side's choice of delivery and order; the link
estimate is None until measured, and the probe goes through the decode connector, its one
writer."""

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from rekv_core.connector import (BadRequest, DecodeConnector, DecodeOffer, DecodeOptions,
                                 HandoffCall, HandoffReply, ModelMismatch, PrefillConnector,
                                 PrefillOptions)
from rekv_core.connector import decode as decode_module
from rekv_core.handoff import (Action, Delivery, HandoffPlan, HandoffTimings, Order, WireBytes)
from rekv_core.handoff.transfer import TransferBook
from rekv_core.model.shapes import get_preset
from rekv_core.plan.calibration import DecodeCalibration, PrefillCalibration
from rekv_core.plan.estimates import LayerCost
from rekv_core.plan.evidence import DecodeCosts
from rekv_core.plan.planner import LINK_SAMPLE_BYTES, Planner

SHAPE = get_preset("smollm2-135m")
L = SHAPE.num_layers


class Receiver:
    address = "127.0.0.1:5000"

    def __init__(self):
        self.opened, self.aborted = [], []

    def open(self, request_id):
        self.opened.append(request_id)

    def abort(self, request_id):
        self.aborted.append(request_id)


@pytest.fixture
def decode():
    model = SimpleNamespace(shape=SHAPE, dtype=torch.float32)
    calibration = DecodeCalibration(SHAPE, LayerCost([512], [2.0]), {"int8": 1.0})
    connector = DecodeConnector(model, calibration, Receiver(),
                                DecodeOptions(("bf16", "int8"), chunk_tokens=256),
                                TransferBook())
    yield connector
    connector.close()


def test_the_offer_carries_no_link_rate_until_a_probe_measured_one(decode):
    offer = decode.offer(512, in_flight=1, queue=0)
    assert offer.costs.link_gbps is None and not decode.link_measured
    assert offer.costs.suffix_scale is None and offer.chunk_tokens == 256
    assert offer.costs.suffix_ms_per_layer == pytest.approx(2.0)
    assert decode.link_gbps == 10.0  # the prior, what its handoffs are filed under
    assert decode.observe_probe((LINK_SAMPLE_BYTES - 1, 0.001)) is None  # too small to time
    assert decode.offer(512, 1, 0).costs.link_gbps is None
    assert decode.observe_probe((2 << 20, 0.01)) == pytest.approx(2 * 2**20 * 8 / 0.01 / 1e9)
    assert decode.link_measured
    assert decode.offer(512, 1, 0).costs.link_gbps == pytest.approx(1.6777216)


def test_a_handoffs_deadline_keeps_time_for_a_local_recompute(decode):
    recompute_s = decode.recompute_s(512)
    assert recompute_s == pytest.approx(2.0 * L / 1e3)
    # the deadline lies between the clock read before the call and after it, whatever the load
    before = time.monotonic()
    pending = decode.begin("req", 512, 8, time_remaining=10.0, transfer_id="req/1")
    after = time.monotonic()
    assert decode.receiver.opened == ["req/1"]
    reserved = 10.0 - 1.5 * recompute_s
    assert before + reserved <= pending.transfer.deadline <= after + reserved
    assert not pending.transfer.trust_predictions  # the link is unmeasured
    assert pending.sealing.key is not None and not pending.sealing.encrypted
    before = time.monotonic()
    short = decode.begin("req", 512, 8, time_remaining=0.05, transfer_id="req/2")
    after = time.monotonic()
    assert before + 0.025 <= short.transfer.deadline <= after + 0.025  # half the call's time
    decode.end(pending)
    decode.end(short)
    decode.observe_probe((2 << 20, 0.01))
    assert decode.begin("req", 512, 8, None, "req/3").transfer.trust_predictions


def test_a_handoff_measures_its_sharing_over_its_suffix_only(decode, monkeypatch):
    """The calibration divides a suffix's time by the requests computing beside it: the mean is
    taken from the boundary's arrival to the suffix's end, not to the complete cache; a
    transfer-only handoff computes nothing here and counts as alone."""
    asked = []
    decode.sharing = SimpleNamespace(average=lambda t0, t1: asked.append((t0, t1)) or 2.5,
                                     close=lambda: None)
    timings = {}
    monkeypatch.setattr(decode_module, "receive_handoff",
                        lambda *args: SimpleNamespace(timings=timings["now"]))
    pending = decode.begin("req", 512, 4, None, "req/1")
    timings["now"] = HandoffTimings(h_s=0.2, x_s=0.9, r_s=0.5, j_s=0.01, total_s=1.11,
                                    suffix_end_s=0.7)
    _, sharing = decode.receive(pending)
    (t0, t1), = asked
    assert sharing == 2.5 and t1 - t0 == pytest.approx(0.5)  # [h, suffix end], not to 1.11
    timings["now"] = HandoffTimings(h_s=0.01, x_s=0.9, j_s=0.01, total_s=0.92)
    assert decode.receive(pending)[1] == 1.0 and len(asked) == 1


def _reply(action, delivery, prefill_ms=100.0):
    return HandoffReply(action, predicted_ms=50.0, model_ms=40.0, prefill_ms=prefill_ms,
                        q_ms=1.0, send_ms=5.0, bytes=WireBytes(), link_gbps=1.0,
                        delivery=delivery)


def test_the_reply_must_name_the_plan_that_arrived():
    delivery = Delivery(True, 256, Order.TOKENS)
    plan = HandoffPlan(Action("int8", 12, L), 600, SHAPE, delivery)
    DecodeConnector.check_reply(plan, _reply(Action("int8", 12, L), delivery))
    with pytest.raises(ValueError, match="int8.*cut=11"):
        DecodeConnector.check_reply(plan, _reply(Action("int8", 11, L), delivery))
    with pytest.raises(ValueError, match="streamed/chunk256"):
        DecodeConnector.check_reply(plan, _reply(Action("int8", 12, L), Delivery(True, 256)))


def test_a_shared_receive_teaches_no_link_rate(decode):
    plan = HandoffPlan(Action.full_bf16(L), 512, SHAPE, Delivery(True))
    result = SimpleNamespace(plan=plan, action=plan.action, link_sample=(4 << 20, 0.01),
                             timings=HandoffTimings(total_s=0.3, x_s=0.2), bytes=WireBytes())
    alone = decode.begin("a", 512, 4, None, "a/1")
    shared_one = decode.begin("b", 512, 4, None, "b/1")  # overlaps `alone`: both are shared
    learned = decode.learn(shared_one, replace_result(result), 1.0, _reply(plan.action,
                                                                            plan.delivery))
    assert learned.link_sample_gbps is None and not decode.link_measured
    decode.end(alone)
    decode.end(shared_one)
    solo = decode.begin("c", 512, 4, None, "c/1")
    learned = decode.learn(solo, replace_result(result), 1.0, _reply(plan.action,
                                                                      plan.delivery, 10.0))
    assert learned.link_sample_gbps == pytest.approx(4 * 2**20 * 8 / 0.01 / 1e9)
    assert learned.observation.prefill_s == pytest.approx(0.01)
    assert decode.link_measured


def replace_result(result):
    """A `HandoffResult` stand-in the connector may `dataclasses.replace`."""
    from rekv_core.handoff import HandoffResult

    return HandoffResult(result.plan, cache=None, logits=None, timings=result.timings,
                         bytes=result.bytes, link_sample=result.link_sample)


def _prefill(stream=True, pipeline=True):
    model = SimpleNamespace(shape=SHAPE, dtype=torch.float32)
    calibration = PrefillCalibration({"int8": 1.0}, layer_cost=LayerCost([512], [2.0]))
    return PrefillConnector(model, calibration, Planner(None),
                            PrefillOptions(("bf16", "int8"), stream, pipeline))


def _call(forced=None, computing=0, accepts_pipelined=True, chunk=256, link=1.0):
    costs = DecodeCosts(2.0, {"int8": 1.0}, 0.0, 0.0, link)
    offer = DecodeOffer(SHAPE.name, L, "127.0.0.1:5000", ("bf16", "int8"), 0, 1, costs,
                        accepts_pipelined=accepts_pipelined, chunk_tokens=chunk,
                        computing=computing)
    return HandoffCall("req", "req/1", list(range(1, 601)), offer, forced_delivery=forced)


def test_the_planner_picks_the_order_only_while_both_pools_are_idle():
    connector = _prefill()

    def orders(call, queue=0):
        return connector._orders(call, connector._delivery(call), queue)

    assert orders(_call()) == frozenset(Order)
    assert orders(_call(), queue=1) == orders(_call(computing=2)) == {Order.LAYERS}
    assert orders(_call(accepts_pipelined=False)) == orders(_call(chunk=0)) == {Order.LAYERS}
    assert _prefill(pipeline=False)._orders(_call(), Delivery(True, 256), 0) == {Order.LAYERS}
    tokens = Delivery(True, 256, Order.TOKENS)
    assert orders(_call(forced=tokens), queue=3) == {Order.TOKENS}
    assert orders(_call(forced=Delivery(True, 256))) == {Order.LAYERS}


def test_the_decision_is_a_plan_in_the_order_it_was_predicted_in():
    connector = _prefill()
    decision = connector.decide(_call())
    plan = decision.plan
    assert plan.seq_len == 600 and plan.delivery.chunk_tokens == 256 and plan.streamed
    chosen = next(r for r in decision.candidates if r.prediction.action == plan.action)
    assert plan.pipelined == chosen.prediction.pipelined
    assert plan.predicted_ms == chosen.expected_ms and decision.inputs.link_measured
    assert any(r.prediction.pipelined for r in decision.candidates)  # both orders were ranked
    unmeasured = connector.decide(_call(link=None))
    assert not unmeasured.inputs.link_measured and unmeasured.rule.value == "unmeasured_link"
    assert unmeasured.inputs.link_gbps == 10.0  # no send measured yet: the prior
    seed = connector.decide(_call(forced=Delivery.seed()))
    assert not seed.plan.streamed and not seed.plan.pipelined


def test_kvprs_per_layer_form_is_ranked_and_forced_only_where_the_decode_worker_takes_it():
    connector, call = _prefill(), _call()
    assert connector.decide(call).inputs.layer_splits
    refused = replace(call, offer=replace(call.offer, accepts_layer_split=False))
    assert not connector.decide(refused).inputs.layer_splits
    forced = Action("bf16", 15, L, layer_split=256)
    connector.check(replace(call, forced_action=forced))
    with pytest.raises(BadRequest, match="^forced_action.layer_split_tokens: the decode worker"):
        connector.check(replace(refused, forced_action=forced))
    with pytest.raises(BadRequest, match="^forced_schedule.pipelined"):
        connector.check(replace(call, forced_action=forced,
                                forced_delivery=Delivery(True, 256, Order.TOKENS)))
    for field, long in (("layer_split_tokens", Action("bf16", 15, L, layer_split=768)),
                        ("split_tokens", Action("bf16", 15, L, split=768))):
        with pytest.raises(BadRequest, match=f"^forced_action.{field}: must be below"):
            connector.check(replace(call, forced_action=long))


def test_a_forced_delivery_the_decode_worker_cannot_take_is_refused_by_name():
    connector = _prefill()
    call = _call(forced=Delivery(True, 256, Order.TOKENS), accepts_pipelined=False)
    with pytest.raises(BadRequest, match="forced_schedule.pipelined"):
        connector.check(call)
    offer = replace(_call().offer, accepts_streamed=False)
    with pytest.raises(BadRequest, match="forced_schedule.streamed"):
        connector.check(replace(_call(forced=Delivery(True)), offer=offer))
    assert not connector.decide(replace(_call(), offer=offer)).plan.streamed  # the default


def test_an_offer_of_another_model_is_refused_naming_both_fingerprints():
    mine, theirs = "ab" * 32, "cd" * 32
    connector = _prefill()
    connector.options = replace(connector.options, fingerprint=mine)
    other = replace(_call(), offer=replace(_call().offer, fingerprint=theirs))
    with pytest.raises(ModelMismatch, match=f"^offer.model_fingerprint: .*{theirs}.*{mine}"):
        connector.check(other)
    connector.check(replace(_call(), offer=replace(_call().offer, fingerprint=mine)))


def test_the_decode_side_offers_its_fingerprint_and_binds_its_key_to_it(decode):
    fingerprint = "ef" * 32
    decode.options = replace(decode.options, fingerprint=fingerprint)
    assert decode.offer(100, 0, 0).fingerprint == fingerprint
    pending = decode.begin("r", 100, 4, None, "r/1")
    try:
        assert pending.sealing.binding == bytes.fromhex(fingerprint)
        assert pending.sealing.message_key not in (None, pending.sealing.key)
    finally:
        decode.abandon(pending, "test over")
        decode.end(pending)


def _busy(call, running=8, budget_ms=150.0, step_ms=120.0):
    return replace(call, offer=replace(call.offer, running_batch=running,
                                       itl_budget_ms=budget_ms, decode_step_ms=step_ms))


@pytest.mark.parametrize("link", [0.1, 1.0, 10.0])
def test_a_busy_batch_moves_the_work_to_the_wire_and_an_idle_worker_to_recompute(link):
    """The same request, planned beside an idle decode worker and beside one whose batch leaves
    a fifth of its ITL budget for a handoff's compute: the busy one gets a larger cut (less
    recompute there), and an engine with no stream running changes nothing."""
    def chosen(call):  # a fresh prefill worker each time: its decisions count as decode backlog
        return _prefill().decide(call).plan.action

    idle = chosen(_call(link=link))
    busy = chosen(_busy(_call(link=link)))
    assert busy.cut > idle.cut
    assert chosen(_busy(_call(link=link), running=0)) == idle
    assert chosen(_busy(_call(link=link), budget_ms=0.0)) == idle


def test_the_offer_carries_the_engines_batch_and_budget():
    model = SimpleNamespace(shape=SHAPE, dtype=torch.float32)
    calibration = DecodeCalibration(SHAPE, LayerCost([512], [2.0]), {"int8": 1.0})
    state = SimpleNamespace(running=5, itl_budget_ms=170.0, step_ms=90.0)
    connector = DecodeConnector(model, calibration, Receiver(), DecodeOptions(("bf16",)),
                                TransferBook(), engine_state=lambda: state)
    try:
        offer = connector.offer(512, in_flight=1, queue=0)
        assert (offer.running_batch, offer.itl_budget_ms, offer.decode_step_ms) == (5, 170.0, 90.0)
    finally:
        connector.close()


def test_lynx_drafts_what_fits_before_the_residuals_are_due(decode):
    """Lynx's draft count: the residuals (half of each int8 layer's codes) at the link estimate
    over the engine's step; without an engine the most (drafting stops when they land)."""
    from rekv_core.plan.lynx_drafts import MAX_DRAFTS
    assert decode.lynx_drafts(512, 30) == MAX_DRAFTS  # no engine
    model = SimpleNamespace(shape=SHAPE, dtype=torch.float32)
    calibration = DecodeCalibration(SHAPE, LayerCost([512], [2.0]), {"int8": 1.0})
    state = SimpleNamespace(running=1, itl_budget_ms=170.0, step_ms=50.0)
    connector = DecodeConnector(model, calibration, Receiver(), DecodeOptions(("int8",)),
                                TransferBook(), engine_state=lambda: state)
    try:
        residual_bytes = 12 * SHAPE.kv_layer_bytes(2048, 1) / 2  # 12 layers of int8 codes
        connector.observe_probe((2 << 20, 2 * 2**20 * 8 / 0.05e9))  # a 0.05 Gb/s link
        wait_ms = residual_bytes * 8 / (connector.link_gbps * 1e9) * 1e3
        assert connector.lynx_drafts(2048, 12) == min(MAX_DRAFTS, int(wait_ms // 50.0))
        assert 0 < connector.lynx_drafts(2048, 2) < MAX_DRAFTS
        connector.observe_probe((2 << 20, 2 * 2**20 * 8 / 100e9))  # much faster: none fit
        for _ in range(20):
            connector.observe_probe((2 << 20, 2 * 2**20 * 8 / 100e9))
        assert connector.lynx_drafts(256, 1) == 0
    finally:
        connector.close()
