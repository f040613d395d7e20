"""The engine's tokens against the single-request reference, through a real `DecodeEngine` and the
real batched step on the embedded model in float32: greedy streams of different prompt lengths
that join and leave mid-batch produce `greedy_generate`'s tokens, and a seeded sampled stream
draws the same tokens alone and in company.

Each request is prefilled here and its first token chosen from the prefill's logits (the caller's
part, as in the decode service); the engine produces the rest. Streams join from another stream's
emit callback (on the engine's thread), so the batch's schedule is the same on every run.
"""

from __future__ import annotations

import pytest

from rekv_core.engine import DecodeEngine, engine_step
from rekv_core.model import KVCache, greedy_generate, prefill
from rekv_core.model.batched import batched_decode_step
from rekv_core.model.bucketed import BucketedDecoder
from rekv_core.model.packed import PackedLinears
from rekv_core.model.sampling import Sampler, SamplingParams
from tests.support.engine_fakes import Observed, budget, stream, wait

PROMPTS = {  # name: (prompt, new tokens)
    "a": ("The capital of France is", 10),
    "b": ("def fibonacci(n):\n    ", 6),
    "c": ("Here is a list of prime numbers: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, "
          "and the next ones are", 8),
}
STEPS = {"plain": lambda model: batched_decode_step, "engine_step": engine_step,
         "bucketed": lambda model: BucketedDecoder(model, max_batch=4, capacity=256)}


def _ready(model, ids, new_tokens, sampler):
    """(cache, first token) as the caller has them when a stream joins."""
    out = prefill(model, ids, boundaries=())
    cache = KVCache.from_layers(out.keys, out.values, capacity=len(ids) + new_tokens)
    return cache, sampler(out.logits)


def _then(recorder, at: int, action):
    """`recorder` as an emit callback that also runs `action` once its `at`-th token arrived."""
    def emit(token, finish, error):
        recorder(token, finish, error)
        if token is not None and len(recorder.tokens) == at:
            action()
    return emit


def _first_new_token(tokens: list[int]) -> int:
    """Index of the first token (after the first) not seen before it: an EOS there stops the
    generation mid-way."""
    return next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])


def _reference(model, tokenizer):
    """Each request's prompt ids, EOS and `greedy_generate` tokens; c stops at an EOS mid-way."""
    ids = {name: tokenizer.encode(prompt) for name, (prompt, _) in PROMPTS.items()}
    want = {name: greedy_generate(model, ids[name], n) for name, (_, n) in PROMPTS.items()}
    eos_at = _first_new_token(want["c"])
    eos = {"a": None, "b": None, "c": want["c"][eos_at]}
    want["c"] = greedy_generate(model, ids["c"], PROMPTS["c"][1], eos["c"])
    assert len(want["c"]) == eos_at + 1 < PROMPTS["c"][1]
    return ids, eos, want


@pytest.fixture(scope="module")
def reference(smollm_fp32, tokenizer):
    return _reference(smollm_fp32, tokenizer)


@pytest.mark.parametrize("step", sorted(STEPS))
def test_batched_greedy_streams_joining_and_leaving_match_the_reference(
        smollm_fp32, reference, step):
    """Three greedy streams of different prompt lengths (one stopping at an EOS mid-way): b joins
    after a's second token, c after b's first, b leaves first; each produces exactly the tokens
    and the finish of `greedy_generate` for its prompt alone, and the batch grew from 1 to 3 and
    shrank back to 1."""
    _joining_and_leaving(smollm_fp32, *reference, STEPS[step](smollm_fp32))


def test_batch_invariant_bf16_streams_are_the_reference_token_for_token(smollm_bf16, tokenizer):
    """In BF16 a GEMM over the batch's rows can flip a near-tie: `invariant` runs each row
    through the single-stream kernels, so the same schedule gives `greedy_generate`'s tokens."""
    _joining_and_leaving(smollm_bf16, *_reference(smollm_bf16, tokenizer),
                         engine_step(smollm_bf16, invariant=True))


def _joining_and_leaving(model, ids, eos, want, step):
    assert len({len(v) for v in ids.values()}) == 3
    observed = Observed()
    engine = DecodeEngine(model, 4, budget(300.0, 100.0), observed, step=step)
    streams, recorders, firsts = {}, {}, {}
    for name, (_, n) in PROMPTS.items():
        cache, firsts[name] = _ready(model, ids[name], n, Sampler())
        streams[name], recorders[name] = stream(name, cache, firsts[name], n - 1, eos=eos[name])
    streams["a"].emit = _then(recorders["a"], 2, lambda: engine.join(streams["b"]))
    streams["b"].emit = _then(recorders["b"], 1, lambda: engine.join(streams["c"]))
    engine.join(streams["a"])
    engine.start()
    try:
        for name in PROMPTS:
            wait(recorders[name].done, f"stream {name} to finish")
    finally:
        engine.close()
    for name in PROMPTS:
        assert recorders[name].error is None, name
        assert [firsts[name]] + recorders[name].tokens == want[name], name
    assert recorders["c"].finish == "eos" and recorders["a"].finish == "length"
    sizes = [batch for batch, _ in observed.steps]
    assert sizes[0] == 1 and max(sizes) == 3 and sizes[-1] == 1, sizes
    assert engine.running() == 0


SAMPLED = SamplingParams(temperature=1.0, top_k=50, seed=7)


def _sampled_run(model, tokenizer, company: bool, params: SamplingParams = SAMPLED) -> list[int]:
    """The tokens of the sampled request 'x' (its own seed), run alone or with two others."""
    requests = {"x": ("Once upon a time", params)}
    if company:
        requests["y"] = ("The capital of France is", SamplingParams())
        requests["z"] = ("My favourite colour is", SamplingParams(temperature=0.7, seed=99))
    observed = Observed()
    engine = DecodeEngine(model, 4, budget(300.0, 100.0), observed, step=engine_step(model))
    recorders, first = {}, {}
    for name, (prompt, sampling) in requests.items():
        sampler = Sampler(sampling)
        cache, first[name] = _ready(model, tokenizer.encode(prompt), 8, sampler)
        joined, recorders[name] = stream(name, cache, first[name], 7, sampler)
        engine.join(joined)
    engine.start()
    try:
        for name, recorder in recorders.items():
            wait(recorder.done, f"stream {name} to finish")
    finally:
        engine.close()
    assert all(r.error is None for r in recorders.values())
    assert max(batch for batch, _ in observed.steps) == len(requests)
    return [first["x"]] + recorders["x"].tokens


def test_a_seeded_sampled_stream_draws_the_same_tokens_alone_and_in_company(
        smollm_fp32, tokenizer):
    """A stream sampled at temperature 1 with seed 7 produces the same 8 tokens alone and in a
    batch of three (a greedy stream and another seeded one beside it); another seed draws other
    tokens, so the equality is the seed's doing, not a peaked distribution's."""
    alone = _sampled_run(smollm_fp32, tokenizer, company=False)
    together = _sampled_run(smollm_fp32, tokenizer, company=True)
    assert len(alone) == 8 and together == alone
    other = _sampled_run(smollm_fp32, tokenizer, company=False,
                         params=SamplingParams(temperature=1.0, top_k=50, seed=8))
    assert other != alone


@pytest.mark.parametrize("invariant", [False, True])
def test_a_bf16_step_reads_each_weight_once_per_batch_unless_invariant(smollm_bf16, tokenizer,
                                                                       monkeypatch, invariant):
    """The engine's BF16 step on three streams: one GEMM of three rows per weight by default; with
    `invariant`, one single-row GEMM per stream and weight, and each stream's logits then the
    single-stream step's bit for bit (which the test above turns into tokens)."""
    import torch
    import torch.nn.functional as F

    from rekv_core.model import decode_step

    model = smollm_bf16
    prompts = [tokenizer.encode(prompt) for prompt, _ in PROMPTS.values()]
    outs = [prefill(model, ids, boundaries=()) for ids in prompts]

    def caches():
        return [KVCache.from_layers(o.keys, o.values, capacity=len(ids) + 2)
                for o, ids in zip(outs, prompts)]

    tokens = [int(o.logits.argmax()) for o in outs]
    rows, real, packed = [], F.linear, PackedLinears.linear
    # every GEMM of the step goes through F.linear, or through oneDNN's packed weights where this
    # CPU packs BF16 ones (AVX-512 BF16, AMX): the rows of each are counted either way
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: rows.append(x.shape[0]) or real(x, w, b))
    monkeypatch.setattr(PackedLinears, "linear",
                        lambda self, x, w, b=None: rows.append(x.shape[0]) or packed(self, x, w, b))
    step = engine_step(model, invariant=invariant)
    batched = step(model, tokens, caches())
    monkeypatch.undo()
    assert set(rows) == ({1} if invariant else {3})
    alone = torch.stack([decode_step(model, t, c) for t, c in zip(tokens, caches())])
    assert batched.shape == alone.shape and bool(torch.isfinite(batched).all())
    if invariant:  # (shared: the larger GEMM's rounding, which BF16 carries through 30 layers)
        assert torch.equal(batched, alone)
