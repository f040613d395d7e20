"""The decode service's engine as real processes: concurrent streams share batched steps.

Both services run the embedded model in float32 on loopback. Requests of different prompt
lengths and lengths of generation are sent at once and staggered, so they join and leave the
batch mid-way; each must produce the single-process reference's greedy tokens, a seeded sampled
stream the same tokens alone and in company, and the decode service's metrics must show steps of
more than one stream. A call cancelled mid-stream leaves the batch; the others finish.
"""

import re
import threading
import time
import urllib.request

import grpc
import pytest
import torch

from rekv_cli.client import generate, generate_request
from rekv_cli.launcher import ServicePair
from rekv_core.model import Model, greedy_generate, load_weights
from services.rpc import rekv_pb2_grpc

TRANSFER = ("bf16", 30)  # the whole cache sent: nothing computes on the decode side but decoding
PROMPTS = (
    ("The capital of France is", 12),
    ("def quicksort(items):\n    ", 20),
    ("Once upon a time, in a small village by the sea, there lived an old fisherman who " * 3, 8),
    ("Here is a list of prime numbers: 2, 3, 5, 7, 11,", 16),
)
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "seed": 11}


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    settings = ["--dtype", "float32", "--torch-threads", "1", "--max-batch", "8"]
    pair = ServicePair(settings, settings, log_dir=tmp_path_factory.mktemp("engine"))
    channel = grpc.insecure_channel(pair.decode_address)
    yield pair, channel
    channel.close()
    assert pair.stop() == {"decode": 0, "prefill": 0}, "services did not stop cleanly"


@pytest.fixture(scope="module")
def reference(tokenizer):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = Model(load_weights("smollm2-135m", torch.float32))
        return {prompt: greedy_generate(model, tokenizer.encode(prompt), n)
                for prompt, n in PROMPTS}
    finally:
        torch.set_num_threads(threads)


def _metrics(pair) -> str:
    with urllib.request.urlopen(f"http://{pair.decode.info['metrics']}/metrics") as response:
        return response.read().decode()


def _batch_steps(text: str) -> tuple[float, float]:
    """(steps of one stream, all steps) from rekv_decode_batch_size."""
    one = float(re.search(r'^rekv_decode_batch_size_bucket\{le="1.0"\} (\S+)$', text, re.M)[1])
    total = float(re.search(r"^rekv_decode_batch_size_count (\S+)$", text, re.M)[1])
    return one, total


def _in_threads(calls):
    results, errors = [None] * len(calls), []

    def run(index, call):
        try:
            results[index] = call()
        except Exception as exc:  # reported below, with the others' outcomes
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for i, thread in enumerate(threads):
        thread.start()
        time.sleep(0.15 * (i % 2))  # some arrive while others already decode
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    return results


def test_concurrent_streams_are_batched_and_match_the_reference(services, reference):
    """Four greedy streams of different prompt and generation lengths, at once: each gets the
    reference's tokens, and the engine ran steps of several streams."""
    pair, channel = services
    before = _batch_steps(_metrics(pair))
    results = _in_threads([
        (lambda p=p, n=n, i=i: generate(channel, f"batched-{i}", p, n, forced_action=TRANSFER,
                                        stop_at_eos=False))
        for i, (p, n) in enumerate(PROMPTS)])
    for (prompt, _), result in zip(PROMPTS, results):
        assert result.token_ids == reference[prompt], prompt
    one, total = _batch_steps(_metrics(pair))
    assert total - before[1] > 0
    assert (total - before[1]) - (one - before[0]) > 0, "no step decoded more than one stream"
    assert re.search(r"^rekv_itl_seconds_count (\S+)$", _metrics(pair), re.M)


def test_seeded_sampling_does_not_depend_on_the_company(services):
    """A seeded sampled stream draws the same tokens alone and beside three greedy streams."""
    _, channel = services
    prompt = PROMPTS[0][0]
    alone = generate(channel, "seeded-alone", prompt, 16, forced_action=TRANSFER,
                     sampling=SAMPLING, stop_at_eos=False)
    calls = [lambda: generate(channel, "seeded-company", prompt, 16, forced_action=TRANSFER,
                              sampling=SAMPLING, stop_at_eos=False)]
    calls += [(lambda p=p, i=i: generate(channel, f"company-{i}", p, 24, forced_action=TRANSFER,
                                         stop_at_eos=False)) for i, (p, _) in enumerate(PROMPTS[1:])]
    together = _in_threads(calls)[0]
    assert together.token_ids == alone.token_ids


def test_a_cancelled_stream_leaves_the_batch(services, reference):
    """A call cancelled mid-stream ends CANCELLED and leaves the batch (the running gauge falls
    back to zero); a stream beside it still completes with the reference's tokens."""
    pair, channel = services
    stub = rekv_pb2_grpc.DecodeStub(channel)
    long_call = stub.Generate(generate_request("to-cancel", PROMPTS[2][0], 400, TRANSFER,
                                               stop_at_eos=False), timeout=300)
    responses = iter(long_call)
    for _ in range(3):  # it decodes in the batch
        next(responses)
    prompt, n = PROMPTS[3]
    beside = _in_threads([lambda: generate(channel, "beside", prompt, n, forced_action=TRANSFER,
                                           stop_at_eos=False)])[0]
    long_call.cancel()
    with pytest.raises(grpc.RpcError) as error:
        list(responses)
    assert error.value.code() == grpc.StatusCode.CANCELLED
    assert beside.token_ids == reference[prompt]
    deadline = time.monotonic() + 5  # a cancelled stream leaves before the next step; 400
    # tokens would decode for about 20 s
    while time.monotonic() < deadline:
        text = _metrics(pair)
        if (float(re.search(r"^rekv_decode_batch (\S+)$", text, re.M)[1]) == 0
                and float(re.search(r"^rekv_decode_waiting (\S+)$", text, re.M)[1]) == 0):
            return
        time.sleep(0.1)
    raise AssertionError(f"the cancelled stream is still in the batch:\n{text[-1500:]}")
