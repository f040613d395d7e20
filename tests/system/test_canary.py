"""The live quality canary through the real services: a broken codec is flagged, a healthy one is
not.

One prefill and one decode process; the prefill service runs with `--fault-inject by_request`, so
a request id `coarse_codec/x` has its prefix coded from K and V rounded to five levels
(services/prefill/faults.py): a handoff that arrives sealed and valid, but lossy far beyond what
the gate passed. The decode service checks every lossy handoff (`--canary-fraction 1`) over a
window of three checks. Healthy int8 handoffs must agree and raise no warning; coarse ones must
be counted as disagreeing, with a high KL, and the warning naming the action must be logged.
Lossless handoffs are never checked, and every request streams its tokens as usual.
"""

import re
import time
import urllib.request

import grpc
import pytest

from rekv_cli.client import generate
from rekv_cli.launcher import ServicePair
from rekv_core.eval.needle import passkey_prompt

THREADS = ["--torch-threads", "1", "--dtype", "bfloat16"]
WINDOW = 3
NEW_TOKENS = 8
HEALTHY, BROKEN = ("int8", 20), ("int8", 29)


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    pair = ServicePair([*THREADS, "--fault-inject", "by_request"],
                       [*THREADS, "--canary-fraction", "1", "--canary-window", str(WINDOW),
                        "--canary-continuation", "6"],
                       log_dir=tmp_path_factory.mktemp("canary"))
    channel = grpc.insecure_channel(pair.decode_address)
    yield pair, channel
    channel.close()
    assert pair.stop() == {"decode": 0, "prefill": 0}


def _checks(pair: ServicePair, action: tuple[str, int]) -> dict[str, float]:
    with urllib.request.urlopen(pair.metrics_url("decode")) as response:
        text = response.read().decode()
    codec, cut = action
    return {outcome: float(value) for outcome, value in re.findall(
        rf'^rekv_canary_checks_total\{{codec="{codec}",cut="{cut}",outcome="(\w+)"\}} (\S+)$',
        text, re.M)}


def _kl_sum(pair: ServicePair, action: tuple[str, int]) -> float:
    with urllib.request.urlopen(pair.metrics_url("decode")) as response:
        text = response.read().decode()
    codec, cut = action
    found = re.search(rf'^rekv_canary_kl_divergence_sum\{{codec="{codec}",cut="{cut}"\}} (\S+)$',
                      text, re.M)
    return float(found.group(1))


def _judged(pair: ServicePair, action: tuple[str, int], count: int) -> dict[str, float]:
    deadline = time.monotonic() + 180
    while True:
        checks = _checks(pair, action)
        if checks.get("agree", 0) + checks.get("disagree", 0) >= count:
            return checks
        assert time.monotonic() < deadline, f"the canary judged {checks} of {action}"
        time.sleep(0.2)


def _send(channel, name: str, key: int, action: tuple[str, int]):
    result = generate(channel, name, passkey_prompt(key, 3, 0.5), NEW_TOKENS,
                      forced_action=action, timeout=120)
    assert len(result.token_ids) == NEW_TOKENS and not result.summary.fallback
    return result


def test_a_healthy_codec_agrees(services):
    pair, channel = services
    for index in range(WINDOW):
        _send(channel, f"healthy-{index}", 31415 + 1111 * index, HEALTHY)
    checks = _judged(pair, HEALTHY, WINDOW)
    assert checks == {"agree": WINDOW}
    assert _kl_sum(pair, HEALTHY) < 0.05 * WINDOW
    _send(channel, "lossless", 27182, ("bf16", 20))  # lossless: never checked
    assert _checks(pair, ("bf16", 20)) == {}
    assert "canary: int8/20" not in pair.decode.log_path.read_text()


def test_a_broken_codec_is_flagged(services):
    pair, channel = services
    for index in range(WINDOW):
        _send(channel, f"coarse_codec/{index}", 31415 + 1111 * index, BROKEN)
    checks = _judged(pair, BROKEN, WINDOW)
    assert checks == {"disagree": WINDOW}
    assert _kl_sum(pair, BROKEN) > 0.1 * WINDOW
    log = pair.decode.log_path.read_text()
    assert re.search(r"WARNING.*canary: int8/29 top-1 agreement \S+ over the last 3 checks is "
                     r"below the gate's", log), log[-3000:]
    assert "fault injection ON: by_request" in pair.prefill.log_path.read_text()
