"""What each worker learns from its handoffs (`rekv_core.plan.calibration`), without a server."""

import pytest

from rekv_core.handoff import Action, ActionKind, HandoffTimings, WireBytes, wire_bytes
from rekv_core.model import get_preset
from rekv_core.plan.calibration import LINK_SAMPLE_BYTES, DecodeCalibration, PrefillCalibration
from rekv_core.plan.evidence import CodecCost, DecodeCosts, HandoffObservation
from rekv_core.plan.estimates import LayerCost
from rekv_core.plan.profile import Profile
from rekv_core.units import MiB

SHAPE = get_preset("smollm2-135m")
L = SHAPE.num_layers
S = 1024


def _decode() -> DecodeCalibration:
    # 10 ms a layer at 1024 tokens; restore: int8 1 ms/MiB
    return DecodeCalibration(SHAPE, LayerCost([256, 1024], [2.5, 10.0]), {"int8": 1.0})


def _seen(action, x_s=0.1, r_s=0.1, j_s=0.002, prefill_s=0.5, sample=None, load=1,
          modelled_ms=200.0) -> HandoffObservation:
    h_s = prefill_s + 0.02
    total = h_s + max(x_s, r_s) + j_s
    return HandoffObservation(action, S, load, HandoffTimings(h_s, x_s, r_s, j_s, total),
                              wire_bytes(action, SHAPE, S), sample, prefill_s, modelled_ms)


def test_a_fresh_decode_side_offers_its_profile_and_no_link():
    costs = _decode().offer(S, load=2)
    assert costs.suffix_ms_per_layer == pytest.approx(20.0)  # two handoffs share the worker
    assert costs.link_gbps is None and costs.join_ms == 0.0 and costs.message_ms == 0.0
    assert costs.restore_ms_per_mib == {"int8": 1.0}
    assert not costs.evidence.measured and not costs.evidence.over_model


def test_the_decode_side_learns_link_suffix_join_and_evidence():
    calibration = _decode()
    joint = Action("int8", 20, L)
    nbytes = 4 * LINK_SAMPLE_BYTES
    # the suffix (10 layers) took twice the profile's 10 ms a layer; 1 Gb/s on the wire
    seen = _seen(joint, r_s=0.2, j_s=0.004, sample=(nbytes, nbytes * 8 / 1e9))
    assert calibration.observe(seen) == pytest.approx(1.0)
    assert calibration.link_gbps == pytest.approx(1.0)
    costs = calibration.offer(S, load=1)
    assert costs.link_gbps == pytest.approx(1.0)
    # the process's first handoff ran cold: it teaches the link, and no cost estimate nor
    # evidence (`RecentHandoffs` leaves out each action's first)
    assert costs.suffix_ms_per_layer == pytest.approx(10.0) and costs.join_ms == 0.0
    assert not costs.evidence.measured and not costs.evidence.over_model
    calibration.observe(seen)
    costs = calibration.offer(S, load=1)
    assert costs.suffix_ms_per_layer == pytest.approx(20.0)
    assert costs.join_ms == pytest.approx(4.0)
    assert seen.handoff_s == pytest.approx(0.02 + 0.2 + 0.004)
    for _ in range(2):
        calibration.observe(seen)
    evidence = calibration.offer(S, load=1).evidence
    measured = evidence.measured[joint]
    assert measured.count == 3  # its time from the receive to the complete cache
    assert measured.median_ms == pytest.approx(seen.timings.total_s * 1e3)
    assert evidence.over_model[ActionKind.JOINT] == pytest.approx(seen.timings.total_s * 1e3 / 200)
    assert calibration.offer(4 * S, load=1).evidence.measured == {}  # another length bucket


def test_a_small_run_does_not_time_the_link():
    calibration = _decode()
    small = LINK_SAMPLE_BYTES // 2
    calibration.observe(_seen(Action("int8", 20, L), sample=(small, small * 8 / 1e9)))
    assert calibration.offer(S, 1).link_gbps is None


def test_the_message_cost_comes_only_from_prefixes_the_suffix_did_not_hold_back():
    calibration = _decode()
    nbytes = 4 * LINK_SAMPLE_BYTES
    joint = Action("int8", 20, L)
    wire = wire_bytes(joint, SHAPE, S)
    wire_ms = (wire.prefix + wire.scales) * 8 / 1e9 * 1e3
    restore_ms = 1.0 * 20 * SHAPE.kv_layer_bytes(S) / MiB
    # a prefix that ends with the suffix says nothing about m (this one sets the link: 1 Gb/s)
    calibration.observe(_seen(joint, x_s=0.11, r_s=0.1, sample=(nbytes, nbytes * 8 / 1e9)))
    assert calibration.link_gbps == pytest.approx(1.0) and calibration.message_ms.samples == 0
    x_ms = wire_ms + restore_ms + 20 * 1.5  # 1.5 ms a message beyond bytes and restore
    calibration.observe(_seen(joint, x_s=x_ms / 1e3, r_s=0.01))
    assert calibration.offer(S, 1).message_ms == pytest.approx(1.5)


def test_a_transfer_only_prefix_is_timed_from_the_end_of_the_prefill():
    """The seed's transfer-only: the receive starts with the request, so its X holds the whole
    prefill before the first layer can leave; the message cost is what the bytes and the restore
    leave of the time after it."""
    calibration = _decode()
    nbytes = 4 * LINK_SAMPLE_BYTES
    calibration.observe(_seen(Action("int8", 20, L), x_s=0.11, r_s=0.1,
                              sample=(nbytes, nbytes * 8 / 1e9)))  # sets the link: 1 Gb/s
    transfer = Action("int8", L, L)
    wire = wire_bytes(transfer, SHAPE, S)
    wire_ms = (wire.prefix + wire.scales) * 8 / 1e9 * 1e3
    restore_ms = 1.0 * L * SHAPE.kv_layer_bytes(S) / MiB
    prefill_s = 0.6
    x_s = prefill_s + (wire_ms + restore_ms + L * 2.0) / 1e3  # 2 ms a message
    calibration.observe(HandoffObservation(
        transfer, S, 1, HandoffTimings(0.0, x_s, 0.0, 0.002, x_s + 0.002), wire, None,
        prefill_s, 200.0))
    assert calibration.offer(S, 1).message_ms == pytest.approx(2.0)


def test_the_prefill_side_stands_in_for_the_link_until_the_decode_side_measures_it():
    calibration = PrefillCalibration({"int8": 0.5}, link_prior_gbps=10.0)
    costs = DecodeCosts(suffix_ms_per_layer=3.0, restore_ms_per_mib={"int8": 0.2}, join_ms=1.0,
                        message_ms=0.5, link_gbps=None)
    before = calibration.cost_inputs(SHAPE, S, costs)
    assert before.link_gbps == 10.0 and not before.link_measured
    calibration.observe_send(8 << 20, (8 << 20) * 8 / 2e9)  # 2 Gb/s, encoding included
    inputs = calibration.cost_inputs(SHAPE, S, costs)
    assert inputs.link_gbps == pytest.approx(2.0) and not inputs.link_measured
    assert inputs.codec_costs == {"int8": CodecCost(0.5, 0.2)}
    assert (inputs.suffix_ms_per_layer, inputs.join_ms, inputs.message_ms) == (3.0, 1.0, 0.5)
    measured = DecodeCosts(3.0, {"int8": 0.2}, 1.0, 0.5, link_gbps=0.3)
    inputs = calibration.cost_inputs(SHAPE, S, measured)
    assert inputs.link_gbps == 0.3 and inputs.link_measured


def test_streamed_and_whole_prefills_are_timed_apart():
    """A streamed prefill computes while its layers are sent: where the sends share its cores,
    each layer takes longer than in a whole prefill, and the planner must not mix the two; until
    one kind has been seen, the other's scale stands in for it."""
    calibration = PrefillCalibration({"int8": 0.5}, 10.0, LayerCost([512], [20.0]))
    calibration.observe_prefill(30, 512, 0.6)  # the first prefill: cold, not learned from
    calibration.observe_prefill(30, 512, 0.9)  # whole: 30 ms a layer, 1.5x the profile
    assert calibration.prefill_ms_per_layer(512) == pytest.approx(30.0)
    assert calibration.prefill_ms_per_layer(512, streamed=True) == pytest.approx(30.0)
    calibration.observe_prefill(10, 512, 0.4, streamed=True)  # streamed: 40 ms a layer
    assert calibration.prefill_ms_per_layer(512, streamed=True) == pytest.approx(40.0)
    assert calibration.prefill_ms_per_layer(512) == pytest.approx(30.0)
    costs = DecodeCosts(3.0, {"int8": 0.2}, 1.0, 0.5, link_gbps=1.0)
    assert calibration.cost_inputs(SHAPE, 512, costs, streamed=True).prefill_ms_per_layer == 40.0
    assert calibration.cost_inputs(SHAPE, 512, costs).prefill_ms_per_layer == 30.0


def test_until_it_has_timed_a_prefill_the_prefill_side_takes_the_decode_sides_scale():
    """Both profiles time a layer alone; in the model's pass a layer is slower on both sides. A
    decode side that measured this (its suffixes at 1.4x its profile) while the prefill side has
    not must not make the prefill look 1.4x cheaper than the suffix."""
    decode = DecodeCalibration(SHAPE, LayerCost([S], [10.0]), {"bf16": 0.0})
    assert decode.offer(S, 1).suffix_scale is None  # nothing measured yet
    for _ in range(2):  # the first handoff runs cold code paths: not learned from
        decode.observe(HandoffObservation(Action.token_only(L), S, 1, HandoffTimings(
            0.0, 0.0, 0.42, 0.0, 0.42), WireBytes(), None, 0.0, 300.0))
    offered = decode.offer(S, 1)
    assert offered.suffix_scale == pytest.approx(1.4)
    assert offered.suffix_ms_per_layer == pytest.approx(14.0)
    prefill = PrefillCalibration({"bf16": 0.0}, 10.0, LayerCost([S], [10.0]))
    assert prefill.cost_inputs(SHAPE, S, offered).prefill_ms_per_layer == pytest.approx(14.0)
    prefill.observe_prefill(30, S, 0.3)  # its first: cold
    prefill.observe_prefill(30, S, 0.33)  # its own: 11 ms a layer, which wins from now on
    assert prefill.cost_inputs(SHAPE, S, offered).prefill_ms_per_layer == pytest.approx(11.0)


def test_an_observation_reports_the_handoff_from_the_end_of_the_prefill():
    seen = HandoffObservation(Action("int8", 20, L), S, 1,
                              HandoffTimings(h_s=0.6, x_s=0.3, r_s=0.2, j_s=0.01, total_s=0.91),
                              WireBytes(), None, prefill_s=0.5, modelled_ms=100.0)
    assert seen.handoff_s == pytest.approx(0.41) and seen.boundary_s == pytest.approx(0.1)


def test_a_codec_the_profile_lacks_is_measured_not_taken_as_free(smollm_fp32, tmp_path):
    profile = Profile("smollm2-135m", "cpu", "float32", 2, LayerCost([256], [2.5]),
                      quantize_ms_per_mib={"int8": 0.4}, restore_ms_per_mib={"int8": 0.3})
    path = tmp_path / "profile.json"
    profile.save(path)
    decode = DecodeCalibration.for_model(smollm_fp32, ("int8", "int4"), str(path))
    assert decode.restore_ms_per_mib["int8"] == 0.3 and decode.restore_ms_per_mib["int4"] > 0
    assert decode.layer_cost.at(256) == 2.5
    prefill = PrefillCalibration.for_model(smollm_fp32, ("int8", "int4"), str(path), 10.0)
    assert prefill.quantize_ms_per_mib["int8"] == 0.4 and prefill.quantize_ms_per_mib["int4"] > 0
