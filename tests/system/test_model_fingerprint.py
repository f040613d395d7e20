"""A rolling upgrade as processes: two prefill replicas whose weights differ (same name, same
shape) behind one decode worker. Every request returns the decode worker's own single-process
reference; the replica of the other weights refuses the offer (FAILED_PRECONDITION naming both
fingerprints), is reported (metrics, log line) and left out after its first refusal; a decode
worker whose every replica serves another model recomputes every request."""

import re
import urllib.request
from dataclasses import replace

import grpc
import pytest
import torch

from rekv_cli.client import generate
from rekv_cli.launcher import ServiceProcess
from rekv_core.model import KVCache, Model, decode_steps, get_preset, load_weights, prefill
from rekv_core.model.weights import synthetic_weights
from tests.support.checkpoints import save_hf_checkpoint
from tests.support.paths import ROOT

NEW_TOKENS = 6
REQUESTS = 6
# random weights give near-uniform logits: a prompt is used only where every greedy step's top two
# logits differ by this much (several BF16 steps), so no near-tie can decide a token
MARGIN = 0.05
SHAPE = replace(get_preset("smollm2-135m").with_layers(4), name="tiny-llama", vocab_size=4096)
# the shipped profile spares each process its start-up measurement: every call forces its action
SETTINGS = ["--dtype", "bfloat16", "--torch-threads", "1", "--max-prompt-tokens", "256",
            "--max-new-tokens", "16", "--codecs", "bf16,int8", "--prefill-incompatible-s", "600",
            "--profile", str(ROOT / "rekv_core/plan/profiles/smollm2-135m.json")]


def _prompt(seed: int) -> list[int]:
    return torch.randint(0, SHAPE.vocab_size, (30 + seed % 7 * 5,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(model: Model, ids: list[int]) -> tuple[list[int], float]:
    """The greedy continuation (as `greedy_generate`) and its smallest top-two logit margin."""
    out = prefill(model, ids, boundaries=())
    step = decode_steps(model, KVCache.from_layers(out.keys, out.values, len(ids) + NEW_TOKENS))
    logits, tokens, margin = out.logits, [], float("inf")
    for _ in range(NEW_TOKENS):
        top = logits.float().reshape(-1).topk(2).values
        margin = min(margin, float(top[0] - top[1]))
        tokens.append(int(torch.argmax(logits)))
        if len(tokens) < NEW_TOKENS:
            logits = step(tokens[-1])
    return tokens, margin


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same model name twice: the weights the decode worker runs, and an upgrade's."""
    root = tmp_path_factory.mktemp("checkpoints")
    return [save_hf_checkpoint(root / version / SHAPE.name,
                               synthetic_weights(SHAPE, torch.bfloat16, seed=seed))
            for seed, version in enumerate(("old", "new"))]


@pytest.fixture(scope="module")
def reference(checkpoints):
    """Prompt -> the decode worker's weights' single-process greedy tokens, on one thread as the
    services run, for the first `REQUESTS` prompt seeds without a near-tie."""
    model = Model(load_weights(str(checkpoints[0]), torch.bfloat16))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        found = {}
        for seed in range(200):
            tokens, margin = _greedy(model, _prompt(seed))
            if margin >= MARGIN:
                found[len(found)] = (_prompt(seed), tokens)
            if len(found) == REQUESTS:
                return found
    finally:
        torch.set_num_threads(threads)
    raise AssertionError(f"fewer than {REQUESTS} prompts with a margin of {MARGIN}")


def _start(role, args, folder, started):
    folder.mkdir()
    started.append(ServiceProcess(role, [*args, *SETTINGS], folder))
    return started[-1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, checkpoints):
    logs = tmp_path_factory.mktemp("fingerprint")
    started = []
    try:
        prefills = [_start("prefill", ["--model", str(path)], logs / f"p{i}", started)
                    for i, path in enumerate(checkpoints)]
        addresses = [p.wait_ready(300)["grpc"] for p in prefills]
        model = ["--model", str(checkpoints[0])]
        mixed = _start("decode", [*model, "--prefill-address", ",".join(addresses)],
                       logs / "mixed", started)
        stranded = _start("decode", [*model, "--prefill-address", addresses[1]],
                          logs / "stranded", started)
        for decode in (mixed, stranded):
            decode.wait_ready(300)
        yield prefills, mixed, stranded
    finally:
        for process in reversed(started):
            process.stop()


def _metrics(process: ServiceProcess) -> str:
    return urllib.request.urlopen(f"http://{process.info['metrics']}/metrics").read().decode()


def _sample(text: str, name: str, **labels) -> float | None:
    selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
    found = re.search(rf"^{name}\{{{re.escape(selector)}\}} (\S+)$", text, re.M)
    return None if found is None else float(found.group(1))


def _run(decode: ServiceProcess, reference) -> dict:
    with grpc.insecure_channel(decode.info["grpc"]) as channel:
        results = {i: generate(channel, f"r{i}", prompt, NEW_TOKENS, stop_at_eos=False,
                               forced_action=("bf16", 2), timeout=120)
                   for i, (prompt, _) in reference.items()}
    for i, result in results.items():
        assert result.token_ids == reference[i][1], f"request {i}"
    return results


def test_the_replica_of_other_weights_is_refused_reported_and_avoided(cluster, reference):
    (same, other), mixed, _ = cluster
    ours, theirs = same.info["model_fingerprint"], other.info["model_fingerprint"]
    assert mixed.info["model_fingerprint"] == ours != theirs

    results = _run(mixed, reference)
    fell_back = [i for i, r in results.items() if r.summary.fallback]
    assert len(fell_back) == 1 and fell_back[0] < 3, fell_back  # its first refusal, then avoided
    assert results[fell_back[0]].summary.fallback_reason.startswith("model_mismatch: prefill: "
                                                                    "FAILED_PRECONDITION")
    assert all(r.summary.action.cut == 2 for i, r in results.items() if i not in fell_back)

    refused = re.findall(r"failed \(model_mismatch\): (.*)", other.log_path.read_text())
    assert refused == [f"offer.model_fingerprint: the decode worker runs model {ours}, this "
                       f"prefill worker {theirs}: their caches are not interchangeable"]
    assert f"serves another model (fingerprint {theirs}, this worker's {ours})" in (
        mixed.log_path.read_text())
    decode_metrics = _metrics(mixed)
    assert _sample(decode_metrics, "rekv_prefill_incompatible", peer=other.info["grpc"]) == 1
    assert _sample(decode_metrics, "rekv_prefill_incompatible", peer=same.info["grpc"]) == 0
    assert _sample(decode_metrics, "rekv_fallbacks_total", reason="model_mismatch") == 1
    for process, fingerprint in ((mixed, ours), (same, ours), (other, theirs)):
        assert _sample(_metrics(process), "rekv_model_info", fingerprint=fingerprint,
                       model=SHAPE.name) == 1, process.role
    assert _sample(_metrics(other), "rekv_failures_total", reason="model_mismatch") == 1


def test_with_every_replica_of_another_model_each_request_is_recomputed(cluster, reference):
    _, _, stranded = cluster
    results = _run(stranded, reference)
    reasons = [r.summary.fallback_reason.split(":")[0] for r in results.values()]
    assert reasons == ["model_mismatch"] * REQUESTS
    assert "every replica serves another model" in results[REQUESTS - 1].summary.fallback_reason
    assert _sample(_metrics(stranded), "rekv_fallbacks_total", reason="model_mismatch") == REQUESTS
