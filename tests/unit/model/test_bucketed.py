"""The bucketed decode step (one slab of caches, static shapes per batch bucket) against the plain
batched step: the same logits to rounding while caches of different lengths join and leave, the
padding rows of a bucket leave the real rows alone, a departed cache's slot is reused and the cache
itself can no longer be stepped, and what does not fit the slab is refused naming the field. The
slots a step fills and frees; and the graph path's bookkeeping on the CPU, its capture stood in
for: one capture per bucket, every step a replay of it. CUDA graph replays themselves are covered
by the `cuda` tests."""

import pytest
import torch

from rekv_core.model import KVCache
from rekv_core.model.batched import batched_decode_step
from rekv_core.model import bucketed
from rekv_core.model.bucketed import BucketedDecoder, batch_buckets
from tests.support.engine_fakes import empty_cache, tiny_model


def _prompted(model, length, seed):
    """A cache holding `length` positions of random K and V (what a handoff delivers)."""
    g = torch.Generator().manual_seed(seed)
    cache = empty_cache(model, capacity=48)
    for layer in range(cache.num_layers):
        cache.keys[layer][:, :length] = torch.randn(cache.keys[layer][:, :length].shape,
                                                    generator=g)
        cache.values[layer][:, :length] = torch.randn(cache.values[layer][:, :length].shape,
                                                      generator=g)
    cache.length = length
    return cache


def _twin(cache):
    """An independent copy, for the plain step."""
    return KVCache.from_layers([k[:, :cache.length].clone() for k in cache.keys],
                               [v[:, :cache.length].clone() for v in cache.values],
                               cache.capacity)


def test_buckets_are_powers_of_two_up_to_max_batch():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)


def test_streams_joining_and_leaving_get_the_plain_steps_logits():
    """Five sequences of different lengths through 12 steps: two start, a third joins at step 3
    (a bucket of 4 with one padding row), one leaves at step 6 and two join at step 8, so a freed
    slot is reused; every step's logits equal the plain batched step's on twin caches."""
    model = tiny_model()
    decoder = BucketedDecoder(model, max_batch=4, capacity=48)
    caches = [_prompted(model, length, seed) for seed, length in enumerate([3, 17, 9, 1, 30])]
    twins = [_twin(c) for c in caches]
    tokens = [5, 11, 23, 42, 7]
    schedule = {0: [0, 1], 3: [0, 1, 2], 6: [0, 2], 8: [0, 2, 3, 4]}
    batch = []
    for step in range(12):
        batch = schedule.get(step, batch)
        got = decoder(model, [tokens[i] for i in batch], [caches[i] for i in batch])
        want = batched_decode_step(model, [tokens[i] for i in batch], [twins[i] for i in batch])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for i, row in zip(batch, want):
            tokens[i] = int(row.argmax())
            assert caches[i].length == twins[i].length
        assert decoder.seated() == len(batch)
    for i in batch:  # the slab holds what the plain step's caches hold
        for layer in range(model.shape.num_layers):
            k, _ = caches[i].layer(layer)
            torch.testing.assert_close(k, twins[i].layer(layer)[0], rtol=1e-5, atol=1e-5)


def test_a_departed_cache_cannot_be_stepped_and_its_slot_is_free():
    model = tiny_model()
    decoder = BucketedDecoder(model, max_batch=2, capacity=48)
    a, b, c = (_prompted(model, 4, seed) for seed in range(3))
    decoder(model, [1, 2], [a, b])
    decoder(model, [1], [a])  # b left
    assert decoder.seated() == 1
    decoder(model, [3, 4], [a, c])  # c takes b's slot
    with pytest.raises(ValueError, match="capacity"):
        decoder(model, [5], [b])


def _slot(decoder, cache) -> int:
    """The slab slot whose rows `cache` is a view of."""
    held = [s for s in range(decoder.pad_slot + 1)
            if cache.keys[0].data_ptr() == decoder.keys[0][s].data_ptr()]
    assert len(held) == 1, held
    return held[0]


def test_a_step_fills_a_slot_per_cache_pads_only_its_own_slot_and_frees_departed_ones():
    """Three caches in a bucket of 4: each gets a slot of its own holding its rows (the padding
    row's slot is none of them), the padding row writes position 0 of the padding slot and
    nothing else, the fourth slot stays untouched; a cache that leaves frees its slot (and can no
    longer read it), and the next newcomer is seated there with its own rows."""
    model = tiny_model()
    decoder = BucketedDecoder(model, max_batch=4, capacity=48)
    a, b, c, d = (_prompted(model, length, seed) for seed, length in enumerate([3, 17, 9, 5]))
    d_keys = [k[:, :5].clone() for k in d.keys]
    decoder(model, [1, 2, 3], [a, b, c])
    slots = [_slot(decoder, cache) for cache in (a, b, c)]
    assert len(set(slots)) == 3 and decoder.pad_slot not in slots
    (free,) = set(range(4)) - set(slots)
    for layer in range(model.shape.num_layers):
        for slab in (decoder.keys[layer], decoder.values[layer]):
            assert not slab[free].any()
            assert slab[decoder.pad_slot, :, 0].any() and not slab[decoder.pad_slot, :, 1:].any()
    decoder(model, [4, 5], [a, c])  # b left
    assert decoder.seated() == 2 and b.capacity == 0 and b.keys[0].numel() == 0
    decoder(model, [6, 7, 8], [a, c, d])
    assert _slot(decoder, d) == slots[1] and d.length == 6
    assert [_slot(decoder, cache) for cache in (a, c)] == [slots[0], slots[2]]
    for layer in range(model.shape.num_layers):
        assert torch.equal(decoder.keys[layer][slots[1], :, :5], d_keys[layer])


class _StandInGraph:
    """A CUDA graph's contract on the CPU: the capture runs the step once (a warm-up) and hands
    back an output buffer that only a replay fills, from the step's input buffers as they are at
    that replay."""

    def __init__(self, forward):
        self.forward, self.replays = forward, 0
        self.output = torch.full_like(forward(), float("nan"))

    def replay(self):
        self.output.copy_(self.forward())
        self.replays += 1


def test_each_bucket_is_captured_once_and_every_step_replays_it(monkeypatch):
    """The graph path with `capture_graph` stood in for: the schedule of the joining-and-leaving
    test runs buckets 2, 4, 2 and 4; each bucket is captured once, each step replays its bucket's
    graph once with that step's tokens, positions and slots, so its logits equal the eager
    decoder's bit for bit, and stay so after later replays rewrite the graph's output."""
    graphs = []

    def capture(device, forward):
        graphs.append(_StandInGraph(forward))
        return graphs[-1], graphs[-1].output

    monkeypatch.setattr(bucketed, "capture_graph", capture)
    model = tiny_model()
    graphed = BucketedDecoder(model, max_batch=4, capacity=48)
    graphed.graph = True  # the CUDA path, its capture stood in for
    eager = BucketedDecoder(model, max_batch=4, capacity=48)
    lengths = [3, 17, 9, 1, 30]
    caches = [_prompted(model, length, seed) for seed, length in enumerate(lengths)]
    twins = [_prompted(model, length, seed) for seed, length in enumerate(lengths)]
    tokens = [5, 11, 23, 42, 7]
    schedule = {0: [0, 1], 3: [0, 1, 2], 6: [0, 2], 8: [0, 2, 3, 4]}
    batch, steps = [], []
    for step in range(12):
        batch = schedule.get(step, batch)
        got = graphed(model, [tokens[i] for i in batch], [caches[i] for i in batch])
        want = eager(model, [tokens[i] for i in batch], [twins[i] for i in batch])
        assert torch.equal(got, want), f"step {step}"
        steps.append((got, want))
        for i, row in zip(batch, want):
            tokens[i] = int(row.argmax())
    assert [g.replays for g in graphs] == [5, 7]  # bucket 2: steps 0-2, 6, 7; bucket 4: the rest
    assert all(torch.equal(got, want) for got, want in steps)


def test_what_does_not_fit_is_refused_naming_the_field():
    model = tiny_model()
    decoder = BucketedDecoder(model, max_batch=2, capacity=16)
    with pytest.raises(ValueError, match=r"caches\[0\]: capacity 48"):
        decoder(model, [1], [_prompted(model, 4, 0)])
    small = [empty_cache(model, capacity=16) for _ in range(3)]
    with pytest.raises(ValueError, match="max_batch 2"):
        decoder(model, [1, 2, 3], small)
    with pytest.raises(ValueError, match="model"):
        decoder(tiny_model(seed=1), [1], small[:1])
    with pytest.raises(ValueError, match="graph"):
        BucketedDecoder(model, max_batch=2, capacity=16, graph=True)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_streams(model, lengths, capacity):
    """Pairs of identical caches of random prompts' K and V (prefilled), one per length."""
    from rekv_core.model import prefill
    pairs = []
    for seed, length in enumerate(lengths):
        ids = torch.randint(0, model.shape.vocab_size, (length,),
                            generator=torch.Generator().manual_seed(seed)).tolist()
        out = prefill(model, ids, boundaries=())
        pairs.append([KVCache.from_layers(out.keys, out.values, capacity) for _ in range(2)]
                     + [int(out.logits.argmax())])
    return pairs


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graph_replays_equal_the_eager_bucketed_step_and_follow_the_plain_one(dtype):
    """Caches of 5 prompt lengths join and leave across buckets 1, 2, 4 and 8: each bucket's graph
    replay is bit-identical to the eager static step (same kernels, same addresses), and in
    float32 its logits follow the plain batched step's (SDPA) to rounding, which holds the Triton
    attention kernel to the reference inside the real step."""
    from rekv_core.model import Model
    from rekv_core.model.shapes import get_preset
    from rekv_core.model.weights import synthetic_weights

    model = Model(synthetic_weights(get_preset("qwen2.5-3b"), dtype, "cuda", shared_layer=True))
    lengths = [1100, 37, 512, 300, 777]
    pairs = _gpu_streams(model, lengths, 1200)
    eager = BucketedDecoder(model, max_batch=8, capacity=1200, graph=False)
    graph = BucketedDecoder(model, max_batch=8, capacity=1200)
    plain = [_twin(c) for c, _, _ in pairs]
    tokens = [token for _, _, token in pairs]
    for step, batch in enumerate([[0], [0, 1], [0, 1, 2], [0, 1, 2, 3, 4], [0, 2, 4], [0, 2, 4],
                                  [0, 2, 4], [4], [4]]):
        got = graph(model, [tokens[i] for i in batch], [pairs[i][1] for i in batch])
        want = eager(model, [tokens[i] for i in batch], [pairs[i][0] for i in batch])
        assert torch.equal(got, want), f"step {step}"
        if dtype == torch.float32:
            torch.testing.assert_close(
                got, batched_decode_step(model, [tokens[i] for i in batch],
                                         [plain[i] for i in batch]), rtol=1e-3, atol=1e-3)
        for i, row in zip(batch, want):
            tokens[i] = int(row.argmax())
