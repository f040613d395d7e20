"""The seed's exactness claim: layers [c, L) rerun from the prefill's h_c give bit-identical K, V
and logits, in the same dtype on the same device; and decoding over a cache agrees with prefill."""

import pytest
import torch

from rekv_core.model import KVCache, decode_step, extend, prefill, run_layers, run_layers_chunk
from tests.support.engine_fakes import empty_cache

CUTS = [0, 1, 7, 15, 29, 30]


@pytest.mark.parametrize("dtype_fixture", ["smollm_fp32", "smollm_bf16"])
def test_suffix_from_boundary_is_bit_identical(request, tokenizer, dtype_fixture):
    model = request.getfixturevalue(dtype_fixture)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    ref = prefill(model, ids)
    assert sorted(ref.hidden) == list(range(model.shape.num_layers + 1))
    for c in CUTS:
        suffix = run_layers(model, ref.hidden[c], start=c)
        assert len(suffix.keys) == model.shape.num_layers - c
        for offset, (k, v) in enumerate(zip(suffix.keys, suffix.values)):
            assert torch.equal(k, ref.keys[c + offset]), f"K of layer {c + offset} from cut {c}"
            assert torch.equal(v, ref.values[c + offset]), f"V of layer {c + offset} from cut {c}"
        assert torch.equal(suffix.logits, ref.logits), f"logits from cut {c}"


def test_decode_step_continues_the_prefill(smollm_fp32, tokenizer):
    ids = tokenizer.encode("Counting: one, two, three, four,")
    full = prefill(smollm_fp32, ids, boundaries=())
    head = prefill(smollm_fp32, ids[:-1], boundaries=())
    cache = KVCache.from_layers(head.keys, head.values, capacity=len(ids) + 4)
    logits = decode_step(smollm_fp32, ids[-1], cache)
    assert cache.length == len(ids)
    torch.testing.assert_close(logits, full.logits, atol=1e-3, rtol=1e-4)
    for layer in range(smollm_fp32.shape.num_layers):
        k, v = cache.layer(layer)
        torch.testing.assert_close(k, full.keys[layer], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, full.values[layer], atol=1e-4, rtol=1e-4)


def test_prefill_keeps_only_requested_boundaries(smollm_fp32):
    out = prefill(smollm_fp32, [1, 2, 3], boundaries=[5, 30])
    assert sorted(out.hidden) == [5, 30]
    assert out.hidden[5].shape == (3, 576)


def test_bad_cut_and_boundary_are_named(smollm_fp32):
    with pytest.raises(ValueError, match="boundaries"):
        prefill(smollm_fp32, [1, 2], boundaries=[31])
    h = torch.zeros(4, 576)
    with pytest.raises(ValueError, match=r"layers \[31, 30\)"):
        run_layers(smollm_fp32, h, start=31)
    with pytest.raises(ValueError, match="h_c: expected shape"):
        run_layers(smollm_fp32, torch.zeros(4, 100), start=3)
    with pytest.raises(ValueError, match="h_c: dtype"):
        run_layers(smollm_fp32, h.to(torch.bfloat16), start=3)


def test_every_entry_point_runs_in_inference_mode(smollm_fp32):
    """Each public pass builds no autograd graph: its outputs are inference tensors even when its
    inputs and the cache were made outside inference mode."""
    model = smollm_fp32
    h = torch.zeros(4, model.shape.hidden_size, dtype=model.dtype)
    assert not h.is_inference()
    assert run_layers_chunk(model, h, 0, 0, empty_cache(model), stop=2).is_inference()
    assert run_layers(model, h, start=28).logits.is_inference()
    assert prefill(model, [1, 2, 3], boundaries=()).logits.is_inference()
    assert extend(model, [1, 2], empty_cache(model, 8)).is_inference()
