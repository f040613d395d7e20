"""Hypothesis over every field of the two gRPC requests: whatever a router or a peer sends, the
conversion either yields a call or raises `InvalidArgument` naming a field, never another error;
and a converted sampling setup samples without error, NaN and inf included.
(`REKV_FUZZ_EXAMPLES` raises the number of cases for a bench run; CI runs a few hundred.)"""

import math
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rekv_core.model.sampling import Sampler
from services import wire_convert
from services.errors import InvalidArgument
from services.rpc import rekv_pb2

L = 30
FIELDS = ("request_id", "prompt", "token_ids", "max_new_tokens", "sampling", "forced_action",
          "transfer_id", "handoff_key", "offer", "predicted_ms", "model_ms", "prefill_ms", "q_ms",
          "send_ms", "link_gbps_estimate", "action", "quality")
CASES = settings(max_examples=int(os.environ.get("REKV_FUZZ_EXAMPLES", "250")), deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])
UINT32 = st.integers(0, 2**32 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
CODECS = st.sampled_from(["bf16", "int8", "int4", "", "int3", "BF16", "\x00"])
QUALITIES = st.sampled_from([0, 1, 2, 3, -1, 2**31 - 1])  # unset, lossless, gated, unknown


def _sampling():
    return st.builds(rekv_pb2.SamplingParams, temperature=FLOATS, top_p=FLOATS, top_k=UINT32,
                     seed=st.integers(0, 2**64 - 1))


@st.composite
def generate_requests(draw):
    request = rekv_pb2.GenerateRequest(request_id=draw(st.text(max_size=200)),
                                       max_new_tokens=draw(UINT32))
    prompt = draw(st.sampled_from(["ids", "text", "none"]))
    if prompt == "ids":
        request.token_ids.ids.extend(draw(st.lists(UINT32, max_size=40)))
    elif prompt == "text":
        request.text = draw(st.text(max_size=200))
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(_sampling()))
    if draw(st.booleans()):
        request.forced_action.codec, request.forced_action.cut = draw(CODECS), draw(UINT32)
    if draw(st.booleans()):
        request.stop_at_eos = draw(st.booleans())
    request.quality = draw(QUALITIES)
    return request


def _converted(convert, *args):
    """`convert(*args)`, or None when it refused with `InvalidArgument` naming a field; any other
    error fails the test."""
    try:
        return convert(*args)
    except InvalidArgument as exc:
        message = str(exc)
        assert any(message.startswith(f) for f in FIELDS) or "." in message.split(":")[0], \
            message
        return None


@CASES
@given(generate_requests())
def test_any_generate_request_converts_or_names_its_field(request):
    call = _converted(wire_convert.generate_call, request, L)
    if call is None:
        return
    assert call.request_id and (call.text is not None or call.token_ids is not None)
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    token = Sampler(call.sampling)(logits)
    assert 0 <= token < 50
    if call.forced_action is not None:
        assert 0 <= call.forced_action.cut <= L
    assert call.quality is None or call.forced_action is None or call.quality.allows(
        call.forced_action)


@st.composite
def handoff_requests(draw):
    request = rekv_pb2.HandoffRequest(
        request_id=draw(st.text(max_size=50)), transfer_id=draw(st.text(max_size=50)),
        token_ids=draw(st.lists(UINT32, max_size=20)), handoff_key=draw(st.binary(max_size=40)))
    offer = request.offer
    offer.ucx_address = draw(st.text(max_size=30))
    offer.codecs.extend(draw(st.lists(CODECS, max_size=4)))
    offer.model = draw(st.sampled_from(["smollm2-135m", "qwen3-8b", ""]))
    offer.num_layers = draw(st.sampled_from([L, 0, 36, 2**32 - 1]))
    offer.model_fingerprint = draw(st.sampled_from(["", "ab" * 32, "AB" * 32, "ab" * 31, "x"]))
    offer.suffix_ms_per_layer, offer.join_ms = draw(FLOATS), draw(FLOATS)
    if draw(st.booleans()):  # absent: not measured
        offer.link_gbps = draw(FLOATS)
    if draw(st.booleans()):
        offer.suffix_scale = draw(FLOATS)
    for codec in draw(st.lists(CODECS, max_size=3)):
        offer.restore_ms_per_mib[codec] = draw(FLOATS)
    for kind in draw(st.lists(st.sampled_from(["joint", "bf16_transfer", "nonsense"]),
                              max_size=3)):
        offer.measured_over_model[kind] = draw(FLOATS)
    for _ in range(draw(st.integers(0, 3))):
        offer.measured.add(action=rekv_pb2.Action(codec=draw(CODECS), cut=draw(UINT32)),
                           median_ms=draw(FLOATS), median_prompt_len=draw(UINT32),
                           count=draw(UINT32))
    if draw(st.booleans()):
        request.forced_action.codec, request.forced_action.cut = draw(CODECS), draw(UINT32)
    request.quality = draw(QUALITIES)
    return request


@CASES
@given(handoff_requests())
def test_any_handoff_request_converts_or_names_its_field(request):
    call = _converted(wire_convert.handoff_call, request, "smollm2-135m", L)
    if call is None:
        return
    assert len(call.sealing.key) == 32 and call.token_ids and call.transfer_id
    assert call.sealing.binding == bytes.fromhex(call.offer.fingerprint) and call.offer.fingerprint
    assert call.quality is not None and request.quality in (1, 2)
    costs = call.offer.costs
    for value in (costs.suffix_ms_per_layer, costs.join_ms, costs.message_ms,
                  *costs.restore_ms_per_mib.values()):
        assert 0 <= value < math.inf
    assert (costs.link_gbps is None) != request.offer.HasField("link_gbps")
    assert costs.link_gbps is None or 0 < costs.link_gbps < math.inf
    assert (costs.suffix_scale is None) != request.offer.HasField("suffix_scale")
    assert costs.suffix_scale is None or 0 < costs.suffix_scale <= wire_convert.MAX_SUFFIX_SCALE
    assert all(0 < r < math.inf for r in costs.evidence.over_model.values())
    for action, m in costs.evidence.measured.items():
        assert 0 <= action.cut <= L and 0 <= m.median_ms < math.inf and m.count


@CASES
@given(st.builds(rekv_pb2.HandoffResponse, action=st.builds(rekv_pb2.Action, codec=CODECS,
                                                             cut=UINT32),
                 predicted_ms=FLOATS, model_ms=FLOATS, prefill_ms=FLOATS, q_ms=FLOATS,
                 send_ms=FLOATS, link_gbps_estimate=FLOATS, queue_depth=UINT32))
def test_any_prefill_reply_converts_or_names_its_field(response):
    reply = _converted(wire_convert.handoff_reply, response, L)
    if reply is None:
        return
    for value in (reply.predicted_ms, reply.model_ms, reply.prefill_ms, reply.q_ms,
                  reply.send_ms, reply.link_gbps):
        assert 0 <= value < math.inf
