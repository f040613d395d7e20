"""Two prefill processes and one decode process on loopback (N prefill : M decode): requests
spread over both prefill replicas, and killing one mid-run loses no request."""

import re
import threading

import grpc
import pytest
import torch

from rekv_cli.client import generate
from rekv_cli.launcher import ServiceProcess
from rekv_core.model import Model, greedy_generate, load_weights
from tests.support.paths import ROOT

NEW_TOKENS = 4
# the shipped profile spares each process its start-up measurement: every call forces its action
SETTINGS = ["--dtype", "bfloat16", "--batch-invariant", "true", "--torch-threads", "1",
            "--max-prompt-tokens", "256",
            "--max-new-tokens", "16", "--codecs", "bf16,int8",
            "--profile", str(ROOT / "rekv_core/plan/profiles/smollm2-135m.json")]


def _prompt(i: int) -> list[int]:
    return torch.randint(0, 4000, (40 + 7 * i,), generator=torch.Generator().manual_seed(i)
                         ).tolist()


@pytest.fixture(scope="module")
def reference():
    model = Model(load_weights("smollm2-135m", torch.bfloat16))
    return {i: greedy_generate(model, _prompt(i), NEW_TOKENS) for i in range(12)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("scaling")
    started = []
    try:
        prefills = []
        for i in range(2):  # one folder each: a process's log and ready file are named by role
            (logs / f"p{i}").mkdir()
            prefills.append(ServiceProcess("prefill", SETTINGS, logs / f"p{i}"))
            started.append(prefills[-1])
        addresses = [p.wait_ready(300)["grpc"] for p in prefills]
        decode = ServiceProcess("decode", ["--prefill-address", ",".join(addresses), *SETTINGS],
                                logs)
        started.append(decode)
        decode.wait_ready(300)
        yield prefills, decode
    finally:
        for process in reversed(started):
            process.stop()


def _served(prefill: ServiceProcess) -> int:
    return len(re.findall(r"request=\S+ transfer=\S+ tokens=", prefill.log_path.read_text()))


def _request(channel, i, results):
    results[i] = generate(channel, f"r{i}", _prompt(i), NEW_TOKENS, forced_action=("bf16", 30),
                          stop_at_eos=False, timeout=120)


def test_requests_spread_and_a_killed_prefill_loses_none(cluster, reference):
    prefills, decode = cluster
    channel = grpc.insecure_channel(decode.info["grpc"])
    results = {}
    for i in range(4):
        _request(channel, i, results)
    assert all(_served(p) >= 1 for p in prefills), [_served(p) for p in prefills]

    threads = [threading.Thread(target=_request, args=(channel, i, results)) for i in range(4, 10)]
    for t in threads:
        t.start()
    prefills[0].process.kill()  # mid-run: some handoffs are negotiating or in flight with it
    for t in threads:
        t.join(180)
    for i in range(10, 12):
        _request(channel, i, results)
    channel.close()

    assert sorted(results) == list(range(12)), "a request was lost"
    for i, result in results.items():
        assert result.token_ids == reference[i], f"request {i}"
    fell_back = sorted(i for i, r in results.items() if r.summary.fallback)
    assert all(i >= 4 for i in fell_back), fell_back
    # once a call has found it unreachable the dead replica is left out: of the requests sent one
    # by one after the kill, at most the first can meet it
    assert len([i for i in fell_back if i >= 10]) <= 1, fell_back
