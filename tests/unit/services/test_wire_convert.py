"""The one module that reads and builds protobuf messages: values survive the round trip, and
what a peer sends is checked field by field."""

import dataclasses

import pytest

from rekv_core.connector import DecodeOffer, HandoffCall, HandoffReply
from rekv_core.handoff import (Action, ActionKind, Delivery, HandoffTimings, Order, Sealing,
                               WireBytes)
from rekv_core.model import get_preset
from rekv_core.plan.calibration import DecodeCalibration
from rekv_core.plan.estimates import LayerCost
from rekv_core.plan.evidence import (MAX_SUFFIX_SCALE, MIN_SUFFIX_SCALE, DecodeCosts, Evidence,
                                     HandoffObservation, Measured)
from rekv_core.plan.quality import Quality
from services import wire_convert
from services.calls import ConnectCall
from services.errors import InvalidArgument
from services.rpc import rekv_pb2

L = 30
FINGERPRINT = "0123456789abcdef" * 4


def _call(link_gbps=0.25, suffix_scale=1.3, **offer_changes) -> HandoffCall:
    evidence = Evidence({ActionKind.JOINT: 1.2},
                        {Action("int8", 21, L): Measured(95.0, 1000, 4),
                         Action.full_bf16(L): Measured(140.0, 1024, 3)},
                        {Action("int8", 21, L): Measured(70.0, 1000, 3)})  # pipelined
    costs = DecodeCosts(suffix_ms_per_layer=3.5, restore_ms_per_mib={"int8": 0.2},
                        join_ms=0.4, message_ms=0.1, link_gbps=link_gbps, evidence=evidence,
                        suffix_scale=suffix_scale)
    offer = dict(model="smollm2-135m", num_layers=L, address="10.0.0.2:5000",
                 codecs=("bf16", "int8"), queue_depth=2, handoffs_in_flight=1, costs=costs,
                 computing=1, backlog_ms=850.0, planned=frozenset({"r0/x", "r9/y"}),
                 fingerprint=FINGERPRINT, running_batch=6, itl_budget_ms=180.0,
                 decode_step_ms=95.5)
    offer.update(offer_changes)
    return HandoffCall("r1", "r1/abc", [1, 2, 3], DecodeOffer(**offer), Action("int8", 15, L),
                       Sealing(bytes(range(32)), True, bytes.fromhex(FINGERPRINT)),
                       forced_delivery=Delivery(True, 256, Order.TOKENS))


@pytest.mark.parametrize("link_gbps, suffix_scale", [(0.25, 1.3), (None, None)])
def test_a_handoff_call_survives_the_wire(link_gbps, suffix_scale):
    call = _call(link_gbps, suffix_scale)
    request = wire_convert.handoff_request(call)
    assert request.offer.HasField("link_gbps") == (link_gbps is not None)
    assert wire_convert.handoff_call(request, "smollm2-135m", L) == call


@pytest.mark.parametrize("suffix_s, offered", [(1000.0, MAX_SUFFIX_SCALE),
                                               (1e-6, MIN_SUFFIX_SCALE)])
def test_a_decode_side_that_timed_an_absurd_suffix_offers_a_scale_the_wire_accepts(suffix_s,
                                                                                 offered):
    """A suffix far slower (a loaded machine) or faster than the profile says: the decode side
    offers its scale clamped to the protocol's bounds, so the prefill side accepts the offer
    instead of failing the request with INVALID_ARGUMENT."""
    shape = get_preset("smollm2-135m")
    calibration = DecodeCalibration(shape, LayerCost([1024], [1.0]), {"bf16": 0.0})
    for _ in range(2):  # the first handoff runs cold code paths: not learned from
        calibration.observe(HandoffObservation(
            Action.token_only(shape.num_layers), 1024, 1,
            HandoffTimings(0.0, 0.0, suffix_s, 0.0, suffix_s), WireBytes(), None, 0.0, 300.0))
    costs = calibration.offer(1024, 1)
    assert costs.suffix_scale == offered
    call = _call()
    call = dataclasses.replace(call, offer=dataclasses.replace(call.offer, costs=costs))
    request = wire_convert.handoff_request(call)
    assert wire_convert.handoff_call(request, "smollm2-135m", L).offer.costs.suffix_scale == offered


def test_an_unmeasured_link_is_absent_not_zero():
    """A peer may not say 0 Gb/s: not measured is the field's absence (an older peer that
    sends a plain 0 sends nothing on the wire, and reads as not measured)."""
    request = wire_convert.handoff_request(_call(link_gbps=None, suffix_scale=None))
    assert not request.offer.HasField("link_gbps") and request.offer.link_gbps == 0.0
    request.offer.link_gbps = 0.0  # explicitly present and zero
    with pytest.raises(InvalidArgument, match="^offer.link_gbps: must be a finite number > 0"):
        wire_convert.handoff_call(request, "smollm2-135m", L)


def test_a_reply_survives_the_wire_with_the_prefill_load():
    reply = HandoffReply(action=Action("int8", 21, L), predicted_ms=95.0, model_ms=90.0,
                         prefill_ms=300.0, q_ms=4.0, send_ms=60.0,
                         bytes=WireBytes(boundary=1000, prefix=4000, scales=125), link_gbps=2.5,
                         queue_depth=3, delivery=Delivery(True, 256, Order.TOKENS))
    got = wire_convert.handoff_reply(wire_convert.handoff_response(reply), L)
    assert got == reply  # the candidates are for the prefill's logs and are not read back


def test_another_model_is_named_before_anything_read_against_it():
    request = wire_convert.handoff_request(_call(model="qwen3-8b", num_layers=36))
    with pytest.raises(InvalidArgument, match="^offer.model: decode runs 'qwen3-8b' with 36"):
        wire_convert.handoff_call(request, "smollm2-135m", L)


def test_unreadable_evidence_is_left_out_not_fatal():
    request = wire_convert.handoff_request(_call())
    request.offer.measured_over_model["warp_drive"] = 3.0
    request.offer.measured[0].action.codec = "int3"
    call = wire_convert.handoff_call(request, "smollm2-135m", L)
    assert call.offer.costs.evidence.over_model == {ActionKind.JOINT: 1.2}
    assert list(call.offer.costs.evidence.measured) == [Action.full_bf16(L)]


@pytest.mark.parametrize("change,field", [
    (lambda r: r.ClearField("transfer_id"), "transfer_id"),
    (lambda r: r.ClearField("token_ids"), "token_ids"),
    (lambda r: r.offer.ClearField("ucx_address"), "offer.ucx_address"),
    (lambda r: r.offer.codecs.append("int3"), "offer.codecs"),
    (lambda r: setattr(r.forced_action, "cut", 31), "forced_action.cut"),
    (lambda r: setattr(r.forced_action, "layer_split_tokens", 100),
     "forced_action.layer_split_tokens"),
    (lambda r: setattr(r.offer, "backlog_ms", -1.0), "offer.backlog_ms"),
    (lambda r: setattr(r.offer, "itl_budget_ms", -1.0), "offer.itl_budget_ms"),
    (lambda r: setattr(r.offer, "decode_step_ms", float("nan")), "offer.decode_step_ms"),
    (lambda r: setattr(r.offer, "suffix_scale", 1e308), "offer.suffix_scale"),
    (lambda r: setattr(r.offer, "suffix_scale", float("nan")), "offer.suffix_scale"),
    (lambda r: setattr(r.offer, "suffix_scale", 0.0), "offer.suffix_scale"),
    (lambda r: setattr(r.offer, "link_gbps", float("inf")), "offer.link_gbps"),
    (lambda r: setattr(r.offer, "link_gbps", -1.0), "offer.link_gbps"),
    (lambda r: setattr(r, "handoff_key", b"short"), "handoff_key"),
    (lambda r: r.offer.ClearField("model_fingerprint"), "offer.model_fingerprint: required"),
    (lambda r: setattr(r.offer, "model_fingerprint", FINGERPRINT.upper()),
     "offer.model_fingerprint: must be 64"),
    (lambda r: setattr(r.offer, "model_fingerprint", FINGERPRINT[1:]),
     "offer.model_fingerprint: must be 64"),
    (lambda r: r.offer.planned_transfers.extend(["t"] * 5000), "offer.planned_transfers"),
])
def test_a_malformed_call_names_its_field(change, field):
    request = wire_convert.handoff_request(_call())
    change(request)
    with pytest.raises(InvalidArgument, match=f"^{field}"):
        wire_convert.handoff_call(request, "smollm2-135m", L)


def test_kvprs_per_layer_form_survives_the_wire_and_a_long_one_names_its_field():
    call = dataclasses.replace(_call(accepts_layer_split=False), forced_delivery=None,
                               forced_action=Action("int8", 15, L, layer_split=256))
    request = wire_convert.handoff_request(call)
    assert request.forced_action.layer_split_tokens == 256
    assert not request.offer.accepts_layer_split
    assert wire_convert.handoff_call(request, "smollm2-135m", L) == call
    wire_convert.check_forced_split(call.forced_action, 257)
    with pytest.raises(InvalidArgument, match="^forced_action.layer_split_tokens: must be below"):
        wire_convert.check_forced_split(call.forced_action, 256)


def test_a_connect_call_survives_the_wire_and_a_bad_one_names_its_field():
    call = ConnectCall("10.0.0.2:5000", "probe/1", bytes(range(32)))
    assert wire_convert.connect_call(wire_convert.connect_request(call)) == call
    plain = ConnectCall("[::1]:5000")
    assert wire_convert.connect_call(wire_convert.connect_request(plain)) == plain
    for bad, field in [(ConnectCall(""), "ucx_address"), (ConnectCall("host"), "ucx_address"),
                       (ConnectCall("h:1", "probe/1", b"short"), "probe_key")]:
        with pytest.raises(InvalidArgument, match=f"^{field}: "):
            wire_convert.connect_call(wire_convert.connect_request(bad))


def _generate(**fields):
    request = rekv_pb2.GenerateRequest(request_id="r", max_new_tokens=4, text="hi", **fields)
    return wire_convert.generate_call(request, L)


def test_the_quality_setting_is_read_checked_and_sent_on():
    assert _generate().quality is None  # unset: the deployment's default applies
    assert _generate(quality=rekv_pb2.QUALITY_LOSSLESS).quality is Quality.LOSSLESS
    assert _generate(quality=rekv_pb2.QUALITY_GATED).quality is Quality.GATED
    with pytest.raises(InvalidArgument, match=r"^quality: must be one of .* got 7"):
        _generate(quality=7)
    lossless = dataclasses.replace(_call(), forced_action=None, quality=Quality.LOSSLESS)
    request = wire_convert.handoff_request(lossless)
    assert request.quality == rekv_pb2.QUALITY_LOSSLESS
    assert wire_convert.handoff_call(request, "smollm2-135m", L) == lossless
    request.quality = rekv_pb2.QUALITY_UNSPECIFIED  # the decode worker resolves its default
    with pytest.raises(InvalidArgument, match="^quality: must be one of"):
        wire_convert.handoff_call(request, "smollm2-135m", L)


def test_a_forced_lossy_action_under_lossless_names_both_fields():
    forced = rekv_pb2.Action(codec="int8", cut=15)
    with pytest.raises(InvalidArgument, match=r"^forced_action: .*lossy, and quality is lossless"):
        _generate(forced_action=forced, quality=rekv_pb2.QUALITY_LOSSLESS)
    assert _generate(forced_action=forced, quality=rekv_pb2.QUALITY_GATED).forced_action
    bf16 = _generate(forced_action=rekv_pb2.Action(codec="bf16", cut=15),
                     quality=rekv_pb2.QUALITY_LOSSLESS)
    assert bf16.forced_action == Action("bf16", 15, L)
    request = wire_convert.handoff_request(dataclasses.replace(_call(), quality=Quality.LOSSLESS))
    with pytest.raises(InvalidArgument, match="^forced_action: .*quality is lossless"):
        wire_convert.handoff_call(request, "smollm2-135m", L)
