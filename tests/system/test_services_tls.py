"""Both gRPC planes over mutual TLS, as real processes: a request with the router's certificate
completes with the decode → prefill call over mTLS too; callers without a certificate, with one
from another CA, or in plaintext are refused; probes reach the plaintext health-only port."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rekv_cli.client import generate
from rekv_cli.launcher import ServicePair
from tests.support.certs import Authority

SETTINGS = ["--dtype", "bfloat16", "--torch-threads", "1", "--max-prompt-tokens", "128",
            "--max-new-tokens", "8", "--codecs", "bf16,int8"]


def _tls(paths, ca) -> list[str]:
    return ["--tls-cert", str(paths["cert"]), "--tls-key", str(paths["key"]),
            "--tls-ca", str(ca)]


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    authority = Authority(folder)
    prefill = authority.issue("prefill", ["rekv-prefill"])
    decode = authority.issue("decode", ["rekv-decode"])
    router = authority.issue("router", ["rekv-router"])
    pair = ServicePair([*SETTINGS, *_tls(prefill, authority.ca)],
                       [*SETTINGS, *_tls(decode, authority.ca), "--tls-server-name",
                        "rekv-prefill"], log_dir=folder / "logs")
    yield pair, authority, router, folder
    assert pair.stop() == {"decode": 0, "prefill": 0}


def _channel(address, ca, paths=None):
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=paths["key"].read_bytes() if paths else None,
        certificate_chain=paths["cert"].read_bytes() if paths else None)
    return grpc.secure_channel(address, credentials,
                               options=[("grpc.ssl_target_name_override", "rekv-decode")])


def test_a_request_with_the_routers_certificate_completes_over_mtls(secured):
    pair, authority, router, _ = secured
    assert pair.decode.info["tls"] and pair.prefill.info["tls"]
    with _channel(pair.decode_address, authority.ca, router) as channel:
        result = generate(channel, "tls-1", list(range(1, 60)), 4, forced_action=("bf16", 30),
                          stop_at_eos=False, timeout=120)
    assert len(result.token_ids) == 4
    assert not result.summary.fallback, result.summary.fallback_reason  # decode → prefill: mTLS
    assert "mutual TLS" in pair.decode.log_path.read_text()


def _refused(channel) -> grpc.StatusCode:
    with channel:
        with pytest.raises(grpc.RpcError) as failure:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return failure.value.code()


def test_callers_without_a_good_certificate_are_refused(secured):
    pair, authority, _, folder = secured
    (folder / "other").mkdir()
    outsider = Authority(folder / "other", "another CA").issue("outsider", ["rekv-router"])
    assert _refused(_channel(pair.decode_address, authority.ca)) == grpc.StatusCode.UNAVAILABLE
    assert _refused(_channel(pair.decode_address, authority.ca, outsider)) == \
        grpc.StatusCode.UNAVAILABLE
    assert _refused(grpc.insecure_channel(pair.decode_address)) == grpc.StatusCode.UNAVAILABLE
    assert _refused(grpc.insecure_channel(pair.prefill.info["grpc"])) == \
        grpc.StatusCode.UNAVAILABLE


def test_probes_reach_the_plaintext_health_only_port(secured):
    pair, *_ = secured
    for process in (pair.prefill, pair.decode):
        with grpc.insecure_channel(process.info["health"]) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as failure:  # nothing else is served there
                channel.unary_unary("/rekv.v1.Decode/Generate")(b"", timeout=10)
            assert failure.value.code() == grpc.StatusCode.UNIMPLEMENTED
