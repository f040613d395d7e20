"""The static-shape decode step (`static_decode.StaticDecoder`): the same tokens and logits as the
dynamic `decode_step` on the embedded model, and on CUDA a graph replay bit-identical to the eager
static step (marker `cuda`)."""

import pytest
import torch

from rekv_core.model import KVCache, Model, decode_step, prefill
from rekv_core.model.shapes import get_preset
from rekv_core.model.static_decode import StaticDecoder
from rekv_core.model.weights import synthetic_weights

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _caches(model, ids, capacity):
    out = prefill(model, ids, boundaries=())
    return [KVCache.from_layers(out.keys, out.values, capacity) for _ in range(2)], out.logits


def test_static_steps_follow_the_dynamic_ones(smollm_fp32, tokenizer):
    model = smollm_fp32
    ids = tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    (dynamic, static), logits = _caches(model, ids, len(ids) + 12)
    decoder = StaticDecoder(model, static)
    assert not decoder.graph
    token = int(logits.argmax())
    for _ in range(10):
        want, got = decode_step(model, token, dynamic), decoder.step(token)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
        assert int(got.argmax()) == int(want.argmax())
        token = int(want.argmax())
    assert static.length == dynamic.length == len(ids) + 10
    for layer in range(model.shape.num_layers):
        for got, want in zip(static.layer(layer), dynamic.layer(layer)):
            assert torch.allclose(got, want, atol=1e-5)


def test_bad_steps_are_named(smollm_fp32):
    model = smollm_fp32
    (_, cache), _ = _caches(model, [1, 2, 3], 4)
    decoder = StaticDecoder(model, cache)
    with pytest.raises(ValueError, match="token_id"):
        decoder.step(model.shape.vocab_size)
    decoder.step(5)
    with pytest.raises(ValueError, match="capacity"):
        decoder.step(5)
    with pytest.raises(ValueError, match="graph"):
        StaticDecoder(model, cache, graph=True)


@pytest.mark.cuda
@CUDA
def test_graph_replays_equal_the_eager_static_step():
    shape = get_preset("qwen2.5-3b")
    model = Model(synthetic_weights(shape, torch.bfloat16, "cuda", shared_layer=True))
    ids = torch.randint(0, shape.vocab_size, (1024,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    (eager_cache, graph_cache), logits = _caches(model, ids, len(ids) + 16)
    eager, graph = StaticDecoder(model, eager_cache, graph=False), StaticDecoder(model, graph_cache)
    token = int(logits.argmax())
    for _ in range(12):
        want, got = eager.step(token), graph.step(token)
        assert torch.equal(got, want)
        token = int(want.argmax())
    for layer in range(shape.num_layers):
        assert torch.equal(graph_cache.keys[layer], eager_cache.keys[layer])


@pytest.mark.cuda
@CUDA
def test_two_requests_may_capture_at_once():
    import threading

    shape = get_preset("qwen2.5-3b")
    model = Model(synthetic_weights(shape, torch.bfloat16, "cuda", shared_layer=True))
    ids = list(range(1, 257))
    caches, logits = _caches(model, ids, len(ids) + 32)
    (reference_cache, _), _ = _caches(model, ids, len(ids) + 32)
    token = int(logits.argmax())
    want = StaticDecoder(model, reference_cache, graph=False).step(token)
    results, errors = {}, []

    def first_step(n):
        try:
            results[n] = StaticDecoder(model, caches[n]).step(token)
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=first_step, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(torch.equal(results[n], want) for n in range(2))
