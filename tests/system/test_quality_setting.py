"""The per-request quality setting through both services as real processes (gRPC and UCX on
loopback, the prefill pacing its sends to a slow link): `lossless` gets exactly the single-process
reference's greedy tokens from a lossless action, the summary says which setting applied, an unset
one takes the deployment's default, the decode worker counts requests by setting, and a bad one is
refused naming its field.

The prefill runs with a policy file of its own that passes `int8` and `int4h` at every cut (the
shipped policy passes no lossy codec since its re-gate), so that `lossless` has lossy actions the
planner ranks beside the lossless ones and must refuse. Whether `gated` then takes a lossy one
depends on this machine's measured costs (they are near-equal here), so that it admits them is
held by `tests/unit/plan/test_quality.py`, not asserted here."""

import re
import urllib.request

import grpc
import pytest
import torch

from rekv_core.handoff import Action
from rekv_core.model import Model, greedy_generate, load_weights
from rekv_core.plan.policy import Policy
from rekv_cli.client import generate, generate_request
from rekv_cli.launcher import ServicePair
from services.rpc import rekv_pb2, rekv_pb2_grpc

PROMPTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Question: Explain what a hash table is to a beginner programmer.\nAnswer:",
)
TOKENS = 24
LOSSY_PASSED = {"int8": 30, "int4h": 30}  # codec -> the largest cut the test's policy passes


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    policy = tmp_path_factory.mktemp("policy") / "smollm2-135m.json"
    Policy("smollm2-135m", (1, 4096), LOSSY_PASSED).save(policy)
    common = ["--dtype", "bfloat16", "--torch-threads", str(torch.get_num_threads()),
              "--codecs", "bf16,int8,int4h,splitzip"]
    pair = ServicePair([*common, "--pace-gbps", "0.05", "--policy", str(policy)], common,
                       log_dir=tmp_path_factory.mktemp("quality"))
    yield pair
    assert pair.stop() == {"decode": 0, "prefill": 0}, "services did not stop cleanly"


@pytest.fixture(scope="module")
def services(pair):
    with grpc.insecure_channel(pair.decode_address) as channel:
        yield channel


@pytest.fixture(scope="module")
def reference(tokenizer):
    model = Model(load_weights("smollm2-135m", torch.bfloat16))
    return {prompt: greedy_generate(model, tokenizer.encode(prompt), TOKENS,
                                    tokenizer.eos_token_id) for prompt in PROMPTS}


def test_lossless_returns_the_references_tokens_from_a_lossless_action(services, reference):
    for index, prompt in enumerate(PROMPTS):
        for attempt in range(2):  # the second on a link the first has measured
            result = generate(services, f"lossless-{index}-{attempt}", prompt, TOKENS,
                              quality="lossless")
            s = result.summary
            assert s.quality == rekv_pb2.QUALITY_LOSSLESS and not s.fallback
            assert Action(s.action.codec, s.action.cut, 30).lossless, s.action_kind
            assert result.token_ids == reference[prompt], f"prompt {index}"


def test_gated_and_the_deployments_default_are_reported_and_counted(services, pair):
    gated = generate(services, "gated", PROMPTS[0], 4, quality="gated").summary
    assert gated.quality == rekv_pb2.QUALITY_GATED
    unset = generate(services, "default", PROMPTS[0], 4).summary
    assert unset.quality == rekv_pb2.QUALITY_GATED  # the services' default (REKV_QUALITY)
    with urllib.request.urlopen(pair.metrics_url("decode"), timeout=10) as response:
        text = response.read().decode()
    counted = dict(re.findall(r'^rekv_quality_requests_total\{quality="(\w+)"\} ([0-9.e+]+)$',
                              text, re.M))
    assert float(counted["gated"]) >= 2


def test_an_unknown_quality_or_a_lossy_action_under_lossless_is_refused(services):
    stub = rekv_pb2_grpc.DecodeStub(services)
    request = generate_request("unknown-quality", PROMPTS[0], 4)
    request.quality = 7
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(request, timeout=120))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("quality:")
    with pytest.raises(grpc.RpcError) as error:
        generate(services, "lossy-forced", PROMPTS[0], 4, forced_action=("int8", 15),
                 quality="lossless")
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error.value.details()
    assert details.startswith("forced_action:") and "quality is lossless" in details
    assert generate(services, "after", PROMPTS[0], 2, quality="lossless").token_ids
