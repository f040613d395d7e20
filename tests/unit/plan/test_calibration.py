"""What each worker learns from its handoffs (`rekv_core.plan.calibration`), without a server."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

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


def _linked(gbps: float = 1.0) -> DecodeCalibration:
    """A decode side past its cold first handoff, its link measured at `gbps`."""
    calibration = _decode()
    nbytes = 4 * LINK_SAMPLE_BYTES
    calibration.observe(_seen(Action("int8", 20, L), x_s=0.11, r_s=0.1,
                              sample=(nbytes, nbytes * 8 / (gbps * 1e9))))
    assert calibration.link_gbps == pytest.approx(gbps) and calibration.message_ms.samples == 0
    return calibration


def _prefix_ms(action: Action, gbps: float, restore_ms_per_mib: float) -> float:
    """What the bytes on the wire and the restore explain of a prefix's time."""
    wire = wire_bytes(action, SHAPE, S)
    return ((wire.prefix + wire.scales) * 8 / (gbps * 1e9) * 1e3
            + restore_ms_per_mib * action.cut * SHAPE.kv_layer_bytes(S) / MiB)


def test_a_prefix_that_ends_with_the_suffix_teaches_no_message_cost():
    """Held back while the suffix ran (X within 1.2x of R, the bound included), a prefix's X
    says how long the suffix took; a suffix of well under a second is no exception."""
    from rekv_core.plan.calibration import PREFIX_HELD_BACK_RATIO

    calibration = _linked()
    joint = Action("int8", 20, L)
    calibration.observe(_seen(joint, x_s=0.11, r_s=0.1))
    calibration.observe(_seen(joint, x_s=PREFIX_HELD_BACK_RATIO * 0.5, r_s=0.5))
    assert calibration.message_ms.samples == 0
    x_ms = _prefix_ms(joint, 1.0, 1.0) + 20 * 0.5
    calibration.observe(_seen(joint, x_s=x_ms / 1e3, r_s=0.01))
    assert calibration.message_ms.samples == 1


def test_the_message_cost_is_what_the_bytes_and_the_restore_leave_per_message():
    """Below a millisecond too, and to the bit the link rate gives: over a slow link the bytes
    are most of X, and m is the small remainder."""
    calibration = _linked(gbps=0.01)
    joint = Action("int8", 20, L)
    x_ms = _prefix_ms(joint, 0.01, 1.0) + 20 * 0.5  # 0.5 ms a message
    calibration.observe(_seen(joint, x_s=x_ms / 1e3, r_s=0.01))
    assert calibration.offer(S, 1).message_ms == pytest.approx(0.5, rel=1e-9)


def test_a_prefix_faster_than_its_bytes_teaches_a_free_message():
    calibration = _linked()
    joint = Action("int8", 20, L)
    x_ms = _prefix_ms(joint, 1.0, 1.0) - 20 * 0.5  # measured under what the model says
    calibration.observe(_seen(joint, x_s=x_ms / 1e3, r_s=0.01))
    assert calibration.message_ms.samples == 1 and calibration.offer(S, 1).message_ms == 0.0


def test_a_codec_without_a_restore_figure_restores_for_free_in_the_message_cost():
    calibration = _linked()  # restore figures: int8 only
    plain = Action("bf16", 20, L)
    x_ms = _prefix_ms(plain, 1.0, 0.0) + 20 * 1.5
    calibration.observe(_seen(plain, x_s=x_ms / 1e3, r_s=0.01))
    assert calibration.offer(S, 1).message_ms == pytest.approx(1.5)


def test_a_one_layer_prefix_teaches_the_message_cost():
    calibration = _linked()
    one = Action("int8", 1, L)
    x_ms = _prefix_ms(one, 1.0, 1.0) + 1.5
    calibration.observe(_seen(one, x_s=x_ms / 1e3, r_s=0.001))
    assert calibration.offer(S, 1).message_ms == pytest.approx(1.5)


def test_streamed_handoffs_and_an_unmeasured_link_teach_no_message_cost():
    """A streamed prefix came before the boundary, so its X is not the messages' time; without
    a measured link the bytes' share of X is unknown."""
    joint = Action("int8", 20, L)
    x_ms = _prefix_ms(joint, 1.0, 1.0) + 20 * 1.5
    calibration = _linked()
    streamed = dataclasses.replace(_seen(joint, x_s=x_ms / 1e3, r_s=0.01), streamed=True)
    calibration.observe(streamed)
    assert calibration.message_ms.samples == 0
    unlinked = _decode()
    for _ in range(2):  # the first is cold
        unlinked.observe(_seen(joint, x_s=x_ms / 1e3, r_s=0.01))
    assert unlinked.link.samples == 0 and unlinked.message_ms.samples == 0


def test_the_suffix_scale_is_per_request_sharing_the_worker():
    """A suffix that ran beside another request (load 2) took twice its own compute: the
    worker's speed is what the profile says."""
    calibration = _decode()
    joint = Action("int8", 20, L)  # 10 layers of suffix, 10 ms each alone
    for _ in range(2):
        calibration.observe(_seen(joint, r_s=0.2, load=2))
    assert calibration.offer(S, 1).suffix_scale == pytest.approx(1.0)


def test_a_suffix_scale_is_learned_from_sub_millisecond_suffixes_and_not_from_a_free_profile():
    fast = DecodeCalibration(SHAPE, LayerCost([S], [0.01]), {"int8": 1.0})
    joint = Action("int8", 20, L)  # 10 layers at 0.01 ms: 0.1 ms expected
    for _ in range(2):
        fast.observe(_seen(joint, r_s=0.0003))
    assert fast.offer(S, 1).suffix_scale == pytest.approx(3.0)
    free = DecodeCalibration(SHAPE, LayerCost([S], [0.0]), {"int8": 1.0})
    for _ in range(2):
        free.observe(_seen(joint, r_s=0.2))
    assert free.offer(S, 1).suffix_scale is None


def test_observe_returns_the_handoffs_link_sample_to_the_bit_or_none():
    calibration = _decode()
    joint = Action("int8", 20, L)
    assert calibration.observe(_seen(joint)) is None
    assert calibration.observe(_seen(joint, sample=(125_000_000, 1.0))) == pytest.approx(
        1.0, rel=1e-12)  # 1 Gb in one second


def test_pipelined_handoffs_are_filed_as_pipelined_evidence():
    calibration = _decode()
    joint = Action("int8", 20, L)
    seen = dataclasses.replace(_seen(joint), pipelined=True)
    for _ in range(3):  # the first is cold
        calibration.observe(seen)
    evidence = calibration.offer(S, 1).evidence
    assert evidence.measured == {} and evidence.measured_pipelined[joint].count == 2


def test_a_prefill_side_without_a_layer_cost_or_layers_learns_nothing():
    none = PrefillCalibration({"int8": 0.5}, 10.0)
    for _ in range(2):
        none.observe_prefill(30, 512, 0.9)
    assert none.prefill_ms_per_layer(512) == 0.0


def test_a_one_layer_prefill_teaches_the_prefill_scale():
    calibration = PrefillCalibration({"int8": 0.5}, 10.0, LayerCost([512], [20.0]))
    calibration.observe_prefill(1, 512, 0.02)  # cold
    calibration.observe_prefill(1, 512, 0.03)
    assert calibration.prefill_ms_per_layer(512) == pytest.approx(30.0)


def test_the_prefill_scale_is_learned_below_a_millisecond_and_never_from_nothing():
    """A tiny layer cost still scales; a zero-time prefill or a free profile teaches nothing
    (and divides by nothing)."""
    fast = PrefillCalibration({"int8": 0.5}, 10.0, LayerCost([512], [0.01]))
    fast.observe_prefill(10, 512, 0.0001)  # cold
    fast.observe_prefill(10, 512, 0.0)  # no time measured
    assert fast.gamma_scale[False].samples == 0
    fast.observe_prefill(10, 512, 0.0002)  # 0.1 ms expected, 0.2 ms taken
    assert fast.prefill_ms_per_layer(512) == pytest.approx(0.02)
    free = PrefillCalibration({"int8": 0.5}, 10.0, LayerCost([512], [0.0]))
    for _ in range(3):
        free.observe_prefill(10, 512, 0.5)
    assert free.gamma_scale[False].samples == 0 and free.prefill_ms_per_layer(512) == 0.0


def _profiled(tmp_path) -> str:
    profile = Profile("smollm2-135m", "cpu", "float32", 2, LayerCost([256, 1024], [2.5, 10.0]),
                      quantize_ms_per_mib={"int8": 0.4}, restore_ms_per_mib={"int8": 0.3})
    path = tmp_path / "profile.json"
    profile.save(path)
    return str(path)


@pytest.fixture
def measured_codecs(monkeypatch):
    """`measure_codec_costs` stubbed: (encode, restore) ms/MiB by device, a GPU's far cheaper;
    the calls it had."""
    from rekv_core.plan import calibration as module

    calls = []

    def measure(codec, shape, prompt_len=512, device="cpu", repeats=3):
        calls.append((codec, str(device)))
        return (7.0, 3.0) if str(device) == "cpu" else (0.07, 0.03)

    monkeypatch.setattr(module, "measure_codec_costs", measure)
    return calls


def test_a_codec_the_profile_lacks_is_measured_for_its_own_side_on_the_models_device(
        tmp_path, measured_codecs):
    """Restore figures for the decode side, encode figures for the prefill side, each measured
    where the model runs."""
    path = _profiled(tmp_path)
    cpu = SimpleNamespace(shape=SHAPE, device=torch.device("cpu"))
    decode = DecodeCalibration.for_model(cpu, ("int8", "int4"), path, link_prior_gbps=3.0)
    assert decode.restore_ms_per_mib == {"int8": 0.3, "int4": 3.0}
    assert decode.link_gbps == 3.0  # the services' prior until a sample
    assert decode.layer_cost.at(1024) == 10.0
    joint = Action("int8", 20, L)
    for _ in range(2):  # learns on the model's layers: 10 of suffix at 10 ms, 0.2 s taken
        decode.observe(_seen(joint, r_s=0.2))
    assert decode.offer(S, 1).suffix_scale == pytest.approx(2.0)
    prefill = PrefillCalibration.for_model(cpu, ("int8", "int4"), path, 10.0)
    assert prefill.quantize_ms_per_mib == {"int8": 0.4, "int4": 7.0}
    gpu = SimpleNamespace(shape=SHAPE, device=torch.device("cuda", 0))
    on_gpu = DecodeCalibration.for_model(gpu, ("int4",), path)
    assert on_gpu.restore_ms_per_mib == {"int4": 0.03}
    assert PrefillCalibration.for_model(gpu, ("int4",), path, 10.0).quantize_ms_per_mib == {
        "int4": 0.07}


def test_without_a_profile_file_the_decode_side_takes_the_cached_profile(monkeypatch):
    from rekv_core.plan import calibration as module

    cached = Profile("smollm2-135m", "cpu", "float32", 2, LayerCost([S], [4.0]),
                     quantize_ms_per_mib={"int8": 0.4}, restore_ms_per_mib={"int8": 0.3})
    monkeypatch.setattr(module, "cached_profile", lambda model, codecs: cached)
    model = SimpleNamespace(shape=SHAPE, device=torch.device("cpu"))
    decode = DecodeCalibration.for_model(model, ("int8",))
    assert decode.layer_cost.at(S) == 4.0 and decode.restore_ms_per_mib == {"int8": 0.3}
