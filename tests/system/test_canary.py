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


def _scrape(pair: ServicePair) -> str:
    with urllib.request.urlopen(pair.metrics_url("decode")) as response:
        return response.read().decode()


def _checks(text: str, action: tuple[str, int]) -> dict[str, float]:
    codec, cut = action
    return {outcome: float(value) for outcome, value in re.findall(
        rf'^rekv_canary_checks_total\{{codec="{codec}",cut="{cut}",outcome="(\w+)"\}} (\S+)$',
        text, re.M)}


def _window(pair: ServicePair, channel, name: str, action: tuple[str, int]
            ) -> tuple[dict[str, float], float]:
    """`WINDOW` requests at `action` named `name/i`; once the canary judged them all, the checks
    by outcome and the KL summed over them."""
    for index in range(WINDOW):
        result = generate(channel, f"{name}/{index}", passkey_prompt(31415 + 1111 * index, 3, 0.5),
                          NEW_TOKENS, forced_action=action, timeout=120)
        assert len(result.token_ids) == NEW_TOKENS and not result.summary.fallback
    deadline = time.monotonic() + 180
    while True:
        text = _scrape(pair)
        checks = _checks(text, action)
        if checks.get("agree", 0) + checks.get("disagree", 0) >= WINDOW:
            break
        assert time.monotonic() < deadline, f"the canary judged {checks} of {action}"
        time.sleep(0.2)
    codec, cut = action
    kl = re.search(rf'^rekv_canary_kl_divergence_sum\{{codec="{codec}",cut="{cut}"\}} (\S+)$',
                   text, re.M)
    return checks, float(kl.group(1))


def test_a_healthy_codec_agrees(services):
    pair, channel = services
    checks, kl = _window(pair, channel, "healthy", HEALTHY)
    assert checks == {"agree": WINDOW} and kl < 0.05 * WINDOW
    lossless = generate(channel, "lossless", passkey_prompt(27182, 3, 0.5), NEW_TOKENS,
                        forced_action=("bf16", 20), timeout=120)
    assert lossless.summary.action.codec == "bf16"
    time.sleep(1.0)
    assert _checks(_scrape(pair), ("bf16", 20)) == {}  # lossless: never checked
    assert "canary: int8/20" not in pair.decode.log_path.read_text()


def test_a_broken_codec_is_flagged(services):
    pair, channel = services
    checks, kl = _window(pair, channel, "coarse_codec", BROKEN)
    assert checks == {"disagree": WINDOW} and kl > 0.1 * WINDOW
    log = pair.decode.log_path.read_text()
    assert re.search(r"WARNING.*canary: int8/29 top-1 agreement \S+ over the last 3 checks is "
                     r"below the gate's", log), log[-3000:]
    assert "fault injection ON: by_request" in pair.prefill.log_path.read_text()
