"""Hypothesis against the running services: every request a router could send to the decode
service, and every call a peer could make to the prefill service, ends with OK or a clear status
(INVALID_ARGUMENT naming its field, or the failure of the peer it named), never INTERNAL or
UNKNOWN (`Generate`, `Handoff` and `Connect`); and afterwards both services still serve, hold
nothing and stop cleanly.
(`REKV_FUZZ_LIVE_EXAMPLES` raises the number of cases for a bench run; CI runs a few dozen.)"""

import os
import re

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rekv_cli.client import generate
from rekv_cli.launcher import ServicePair
from services.rpc import rekv_pb2, rekv_pb2_grpc
from tests.unit.services.test_fuzz_requests import FIELDS, generate_requests, handoff_requests

CASES = settings(max_examples=int(os.environ.get("REKV_FUZZ_LIVE_EXAMPLES", "25")),
                 deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.function_scoped_fixture])
CLEAR = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
# where a fuzzed offer asks the prefill service to send: nowhere that answers, never a real host
ADDRESSES = st.sampled_from(["", "x", "127.0.0.1:1", "[::1]:1", "host:port", "127.0.0.1:99999",
                             ":1", "127.0.0.1:"])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    settings_ = ["--dtype", "bfloat16", "--torch-threads", "1", "--max-prompt-tokens", "48",
                 "--max-new-tokens", "3", "--handoff-timeout-s", "10"]
    pair = ServicePair(settings_, settings_, log_dir=tmp_path_factory.mktemp("fuzz-live"))
    decode = grpc.insecure_channel(pair.decode_address)
    prefill = grpc.insecure_channel(pair.prefill.info["grpc"])
    yield pair, rekv_pb2_grpc.DecodeStub(decode), rekv_pb2_grpc.PrefillStub(prefill)
    decode.close()
    prefill.close()
    assert pair.stop() == {"decode": 0, "prefill": 0}


def _named(details: str) -> bool:
    """The message starts with a request field (the prompt's `text` or `token_ids`, one of the
    others, or a nested one)."""
    field = details.split(":")[0]
    return any(field.startswith(f) for f in (*FIELDS, "text")) or "." in field


@CASES
@given(request=generate_requests())
def test_any_generate_call_ends_with_ok_or_a_clear_status(pair, request):
    _, decode, _ = pair
    try:
        responses = list(decode.Generate(request, timeout=60))
        assert responses[-1].HasField("summary")
    except grpc.RpcError as exc:
        assert exc.code() in CLEAR, (exc.code(), exc.details())
        assert _named(exc.details()), exc.details()


@CASES
@given(request=handoff_requests(), address=ADDRESSES, same_model=st.booleans())
def test_any_handoff_call_ends_with_ok_or_a_clear_status(pair, request, address, same_model):
    services, _, prefill = pair
    request.offer.ucx_address = address
    if same_model:  # else the drawn fingerprint: absent, malformed, or another model's
        request.offer.model_fingerprint = services.prefill.info["model_fingerprint"]
    try:
        prefill.Handoff(request, timeout=60)
    except grpc.RpcError as exc:
        # a call that passed every check fails on the address it named: the peer's failure
        assert exc.code() in CLEAR | {grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.FAILED_PRECONDITION}, (exc.code(),
                                                                             exc.details())
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            assert _named(exc.details()), exc.details()
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
            assert exc.details().startswith("offer.model_fingerprint: "), exc.details()
            assert not same_model


@CASES
@given(address=ADDRESSES, probe_id=st.text(max_size=40), key=st.binary(max_size=40))
def test_any_connect_call_ends_with_ok_or_a_clear_status(pair, address, probe_id, key):
    _, _, prefill = pair
    request = rekv_pb2.ConnectRequest(ucx_address=address, probe_id=probe_id, probe_key=key)
    try:
        prefill.Connect(request, timeout=60)
    except grpc.RpcError as exc:
        assert exc.code() in CLEAR | {grpc.StatusCode.UNAVAILABLE}, (exc.code(), exc.details())
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            assert exc.details().split(":")[0] in ("ucx_address", "probe_key"), exc.details()


def test_after_the_fuzzing_both_services_serve_and_hold_nothing(pair):
    services, _, _ = pair
    with grpc.insecure_channel(services.decode_address) as channel:
        result = generate(channel, "after-fuzz", "The capital of France is", 3,
                          forced_action=("bf16", 15))
    assert len(result.token_ids) == 3 and not result.summary.fallback
    for role in ("decode", "prefill"):
        import urllib.request

        text = urllib.request.urlopen(services.metrics_url(role)).read().decode()
        internal = re.search(r'^rekv_failures_total\{reason="internal"\} (\S+)$', text, re.M)
        assert internal is None or float(internal.group(1)) == 0, role
        for name in ("rekv_transport_pending", "rekv_handoffs_in_flight"):
            assert float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)) == 0, (role, name)
    torch.manual_seed(0)  # nothing here depends on it: a marker that the module ran to the end


@pytest.mark.parametrize("address", ["host:port", "127.0.0.1:1", "127.0.0.1:99999", "[::1]:1"])
def test_a_valid_call_naming_a_bad_data_plane_address_gets_a_clear_status(pair, address):
    _, _, prefill = pair
    request = rekv_pb2.HandoffRequest(request_id="r", transfer_id="r/1", token_ids=[1, 2, 3],
                                      handoff_key=bytes(32))
    request.offer.model, request.offer.num_layers = "smollm2-135m", 30
    request.offer.model_fingerprint = pair[0].prefill.info["model_fingerprint"]
    request.offer.ucx_address = address
    request.quality = rekv_pb2.QUALITY_GATED
    with pytest.raises(grpc.RpcError) as error:
        prefill.Handoff(request, timeout=60)
    expected = (grpc.StatusCode.UNAVAILABLE if address in ("127.0.0.1:1", "[::1]:1")
                else grpc.StatusCode.INVALID_ARGUMENT)
    assert error.value.code() == expected, error.value.details()
