"""The services' lifecycle as real processes: a decode worker whose prefill replica is not there
serves by recomputing locally, and SIGTERM while requests run ends each one correctly or with a
clear status, both processes exiting 0. The answers are checked against the single-process BF16
reference (tests/support/reference.py), as in test_services_e2e.py."""

import os
import re
import threading
import urllib.request

import grpc
import pytest
import torch

from rekv_cli.client import generate
from rekv_cli.launcher import ServicePair, ServiceProcess
from rekv_core.cpu_bf16 import native
from tests.support.reference import greedy_reference

PROMPTS = ("The capital of France is",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")


@pytest.fixture(scope="module")
def reference(tokenizer):
    return greedy_reference(tokenizer)


def test_unreachable_prefill_falls_back_to_local_recompute(tmp_path, reference):
    """No prefill service at the configured address: the request still completes, from a cache
    the decode worker computed itself, and says so."""
    decode = ServiceProcess("decode", ["--prefill-address", "127.0.0.1:1", "--dtype",
                                       "bfloat16", "--torch-threads",
                                       str(torch.get_num_threads())], tmp_path)
    try:
        info = decode.wait_ready(300)
        with grpc.insecure_channel(info["grpc"]) as channel:
            result = generate(channel, "orphan", PROMPTS[0], 8)
    finally:
        assert decode.stop() == 0
    assert result.summary.fallback and "UNAVAILABLE" in result.summary.fallback_reason
    assert result.summary.action_kind == "token_recompute"
    assert result.token_ids == reference(PROMPTS[0], 8)


@pytest.mark.parametrize("cap", [{}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}], ids=["machine", "avx2"])
def test_auto_computes_in_bf16_only_where_the_cpu_has_it_and_says_so(tmp_path, cap):
    """`REKV_DTYPE=auto`: the service's startup log and `rekv_compute_info` give the dtype this
    CPU's BF16 support calls for, and why; under a cap below AVX-512 BF16, float32 on any CPU."""
    env = {"REKV_DTYPE": "auto", **cap}
    support = native(environ={**os.environ, **env})
    dtype = "bfloat16" if support.native else "float32"
    reason = (f"auto: native BF16 on this CPU ({support.reason})" if support.native
              else f"auto: {support.reason}")
    assert cap == {} or dtype == "float32"
    decode = ServiceProcess("decode", ["--prefill-address", "127.0.0.1:1", "--torch-threads",
                                       "1"], tmp_path, env=env)
    try:
        info = decode.wait_ready(300)
        metrics = urllib.request.urlopen(f"http://{info['metrics']}/metrics").read().decode()
    finally:
        assert decode.stop() == 0
    assert f"decode computes in {dtype} on cpu ({reason}), 1 torch thread(s)" in (
        decode.log_path.read_text())
    sample = re.escape(f'rekv_compute_info{{device="cpu",dtype="{dtype}",reason="{reason}"}} 1.0')
    assert re.search(rf"^{sample}$", metrics, re.M), metrics


def test_sigterm_finishes_or_cleanly_fails_in_flight_requests(tmp_path, reference):
    """SIGTERM while requests are running: each one completes correctly or ends with a clear
    status, never a wrong answer, and both processes exit 0."""
    settings = ["--dtype", "bfloat16", "--batch-invariant", "true", "--torch-threads",
                str(torch.get_num_threads()),
                "--shutdown-grace-s", "30"]
    pair = ServicePair(settings, settings, log_dir=tmp_path)
    outcomes = []

    def call(index):
        with grpc.insecure_channel(pair.decode_address) as channel:
            try:
                outcomes.append(("ok", index, generate(channel, f"drain-{index}", PROMPTS[1], 32,
                                                       ("int8", 15)).token_ids))
            except grpc.RpcError as exc:
                outcomes.append(("error", index, exc.code()))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    threading.Event().wait(1.0)  # both requests are in flight
    codes = pair.stop()
    for thread in threads:
        thread.join(60)
    assert codes == {"decode": 0, "prefill": 0}
    assert len(outcomes) == 2
    for kind, _, result in outcomes:
        if kind == "ok":
            assert len(result) == 32 and result[0] == reference(PROMPTS[1], 1)[0]
        else:
            assert result in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert any(kind == "ok" for kind, _, _ in outcomes)  # the grace period let them finish
