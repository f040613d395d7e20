"""examples/router.py against real services: one prefill process and two decode replicas pointed at
it, all on 127.0.0.1, started once for the module.

The services run the embedded model in BF16 with this process's thread count, and the calls force
the lossless full BF16 transfer, so whichever replica serves a prompt must reproduce the
single-process greedy reference token for token (as in test_services_e2e.py).
"""

import importlib.util
import sys
import threading
import time
from collections import Counter

import pytest
import torch

from rekv_core.model import Model, greedy_generate, load_weights
from rekv_cli.launcher import ServiceProcess
from tests.support.paths import ROOT

PROFILE = ROOT / "rekv_core" / "plan" / "profiles" / "smollm2-135m.json"
READY_S = 240.0  # start-up of one service, under a loaded CI machine
LOSSLESS = ("bf16", 30)  # smollm2-135m has 30 layers: every layer transferred in BF16
NEW = 6
PROMPTS = ("The capital of France is", "def fibonacci(n):\n",
           "The grass is green. The sky is blue. The pass key is 4417. The pass key is")


def _load_example():
    spec = importlib.util.spec_from_file_location("rekv_router_example",
                                                  ROOT / "examples" / "router.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


example = _load_example()


@pytest.fixture(scope="module")
def reference(tokenizer):
    """The single-process greedy reference of every prompt, computed in a thread that overlaps the
    services' start-up (it asks for this fixture first)."""
    expected, errors = {}, []

    def compute():
        try:
            model = Model(load_weights("smollm2-135m", torch.bfloat16))
            for prompt in PROMPTS:
                expected[prompt] = greedy_generate(model, tokenizer.encode(prompt), NEW,
                                                   tokenizer.eos_token_id)
        except BaseException as error:  # noqa: BLE001 - reported by tokens()
            errors.append(error)

    thread = threading.Thread(target=compute, name="reference", daemon=True)
    thread.start()

    def tokens(prompt: str) -> list[int]:
        thread.join(READY_S)
        assert not thread.is_alive() and not errors, f"no reference: {errors}"
        return expected[prompt]

    return tokens


@pytest.fixture(scope="module")
def services(tmp_path_factory, reference):
    """(prefill, [decode a, decode b]); each process in its own log directory, since the ready
    file is named after the role. The shipped profile spares each one a start-up measurement."""
    settings = ["--dtype", "bfloat16", "--batch-invariant", "true",
                "--torch-threads", str(torch.get_num_threads()),
                "--max-prompt-tokens", "128", "--max-new-tokens", "32",
                "--shutdown-grace-s", "5", "--profile", str(PROFILE)]
    started = []
    try:
        prefill = ServiceProcess("prefill", settings, tmp_path_factory.mktemp("prefill"))
        started.append(prefill)
        address = prefill.wait_ready(READY_S)["grpc"]
        decodes = [ServiceProcess("decode", ["--prefill-address", address, *settings],
                                  tmp_path_factory.mktemp(f"decode-{name}")) for name in "ab"]
        started += decodes
        for decode in decodes:  # both load at once
            decode.wait_ready(READY_S)
        yield prefill, decodes
    finally:
        codes = [process.stop() for process in reversed(started)]
    assert codes == [0] * len(started), "a service did not stop cleanly"


def _addresses(services) -> list[str]:
    return [decode.info["grpc"] for decode in services[1]]


def _complete(router, index, prompt=None, n=NEW):
    return router.complete(prompt or PROMPTS[index % len(PROMPTS)], n,
                           request_id=f"router-test-{index}", forced_action=LOSSLESS,
                           timeout=60.0)


def test_least_loaded_spreads_calls_and_every_replica_matches_the_reference(services, reference):
    addresses = _addresses(services)
    with example.Router(addresses, health_interval_s=0.5) as router:
        assert all(s["healthy"] for s in router.stats().values())
        results = [_complete(router, i) for i in range(6)]
        stats = router.stats()
    served = Counter(result.address for result in results)
    assert set(served) == set(addresses) and min(served.values()) >= 1, served
    for index, result in enumerate(results):  # each prompt went to both replicas
        assert result.token_ids == reference(PROMPTS[index % len(PROMPTS)]), result.address
        assert result.summary.action.cut == LOSSLESS[1] and not result.summary.fallback
    assert {a: (s["calls"], s["served"], s["unavailable"], s["in_flight"])
            for a, s in stats.items()} == {a: (served[a], served[a], 0, 0) for a in addresses}


def test_least_loaded_avoids_a_replica_with_a_call_in_flight(services, reference):
    with example.Router(_addresses(services)) as router:
        held = router.generate(PROMPTS[0], NEW, request_id="held", forced_action=LOSSLESS)
        busy, first = next(held)  # the call is in flight until its stream is read to the end
        others = [_complete(router, i) for i in range(3)]
        rest = list(held)
        assert router.stats()[busy]["in_flight"] == 0
    assert all(other.address != busy for other in others)
    tokens = [*first.token_ids] + [t for _, response in rest for t in response.token_ids]
    assert {address for address, _ in rest} == {busy} and tokens == reference(PROMPTS[0])


def test_round_robin_alternates_whatever_the_load(services):
    addresses = _addresses(services)
    with example.Router(addresses, policy="round_robin") as router:
        held = router.generate(PROMPTS[0], 4, request_id="rr-held", forced_action=LOSSLESS)
        assert next(held)[0] == addresses[0]
        order = [_complete(router, i, n=2).address for i in range(4)]
        list(held)
    assert order == [addresses[1], addresses[0]] * 2


def test_main_prints_the_stream_and_the_replica(services, capsys):
    addresses = _addresses(services)
    argv = [arg for address in addresses for arg in ("--decode", address)]
    assert example.main([*argv, "--prompt", PROMPTS[0], "--max-new-tokens", "3",
                         "--requests", "2"]) == 0
    out = capsys.readouterr().out
    assert all(f"[served by {address}: " in out for address in addresses), out


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        threading.Event().wait(0.05)
    return condition()


def test_a_stopped_replica_is_routed_around_and_no_call_is_lost(services, reference):
    """Runs last: it stops replica a. A router that checks health only once meets the dead replica
    on its next call and retries it on b (the UNAVAILABLE rule); a router that checks often takes
    it out of rotation before any call fails."""
    a, b = _addresses(services)
    retrying = example.Router([a, b], health_interval_s=3600.0)
    checking = example.Router([a, b], health_interval_s=0.2, health_timeout_s=0.5)
    try:
        assert all(s["healthy"] for r in (retrying, checking) for s in r.stats().values())
        assert services[1][0].stop() == 0
        results = [(i, _complete(retrying, i)) for i in range(4)]
        assert [r.address for _, r in results] == [b] * 4
        assert retrying.stats()[a] == {"healthy": False, "in_flight": 0, "calls": 1,
                                       "served": 0, "unavailable": 1}
        assert _wait(lambda: not checking.stats()[a]["healthy"], 10.0)
        results += [(i, _complete(checking, i)) for i in range(3)]
        assert checking.stats()[a]["calls"] == 0 and checking.stats()[b]["served"] == 3
    finally:
        retrying.close()
        checking.close()
    for index, result in results:
        assert result.token_ids == reference(PROMPTS[index % len(PROMPTS)])
