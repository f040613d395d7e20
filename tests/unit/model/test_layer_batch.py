"""`layer_forward_batch`: several prompts through each layer in one call. Invariant mode gives each
prompt the lone prefill's K, V and hidden states bit for bit; shared mode (one GEMM per weight
over every row) agrees with it to the rounding of another summation order, checked in float64,
where any mix-up of rows, positions or keys between prompts would show far above that rounding."""

import pytest
import torch

from rekv_core.model import KVCache, prefill
from rekv_core.model.blocks import EXEC_BLOCK, chunk_bounds
from rekv_core.model.executor import embed
from rekv_core.model.layer_batch import Segment, layer_forward_batch

LENGTHS = [3, 40, 300, 17]  # one longer than an execution block
CHUNKED = [600, 5, 260]  # run in row chunks of one block, beside a short prompt


def _prompts(model, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.shape.vocab_size, (n,), generator=gen).tolist()
            for n in lengths]


def _cache(model, seq_len):
    shape = model.shape
    return KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, seq_len, model.dtype)


def _batched_prefill(model, prompts, invariant, chunk_tokens=0, with_cache=True):
    """Every prompt through every layer, each layer one call per round of chunks (a prompt's
    r-th chunk of rows in round r; chunk_tokens 0: one chunk). Returns the states leaving the
    last layer and each prompt's cache (or, without caches, its per-layer K and V)."""
    hs = [embed(model, ids) for ids in prompts]
    caches = [_cache(model, len(ids)) if with_cache else None for ids in prompts]
    kv = [[] for _ in prompts]
    bounds = [chunk_bounds(len(ids), chunk_tokens) for ids in prompts]
    for index in range(model.shape.num_layers):
        rows_out = [[] for _ in prompts]
        for r in range(max(len(b) for b in bounds)):
            members = [i for i, b in enumerate(bounds) if r < len(b)]
            segs = [Segment(hs[i][bounds[i][r][0]:bounds[i][r][1]], bounds[i][r][0], caches[i])
                    for i in members]
            for i, out in zip(members, layer_forward_batch(model, index, segs, invariant)):
                rows_out[i].append(out.h)
                if not with_cache:
                    kv[i].append((out.keys, out.values))
        hs = [torch.cat(parts) for parts in rows_out]
    return hs, (caches if with_cache else kv)


def _check_lone(model, prompts, hs, caches_or_kv, same, with_cache=True):
    """Each prompt's last states and every layer's K and V `same` as its lone prefill's."""
    n_layers = model.shape.num_layers
    for i, ids in enumerate(prompts):
        ref = prefill(model, ids, boundaries=[n_layers])
        same(hs[i], ref.hidden[n_layers], f"prompt {i}: h_L")
        for layer in range(n_layers):
            k, v = (caches_or_kv[i].layer(layer, len(ids)) if with_cache
                    else caches_or_kv[i][layer])
            same(k, ref.keys[layer], f"prompt {i}: K of layer {layer}")
            same(v, ref.values[layer], f"prompt {i}: V of layer {layer}")


def _equal(got, want, what):
    assert torch.equal(got, want), what


@pytest.mark.parametrize("dtype_fixture", ["smollm_fp32", "smollm_bf16"])
@pytest.mark.parametrize("with_cache", [False, True])
def test_invariant_mode_is_the_lone_prefill_bit_for_bit(request, dtype_fixture, with_cache):
    model = request.getfixturevalue(dtype_fixture)
    prompts = _prompts(model, LENGTHS)
    hs, kv = _batched_prefill(model, prompts, invariant=True, with_cache=with_cache)
    _check_lone(model, prompts, hs, kv, _equal, with_cache)


@pytest.mark.parametrize("dtype_fixture", ["smollm_fp32", "smollm_bf16"])
def test_invariant_mode_in_row_chunks_is_the_lone_prefill_bit_for_bit(request, dtype_fixture):
    model = request.getfixturevalue(dtype_fixture)
    prompts = _prompts(model, CHUNKED, seed=1)
    hs, caches = _batched_prefill(model, prompts, invariant=True, chunk_tokens=EXEC_BLOCK)
    _check_lone(model, prompts, hs, caches, _equal)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    # float64's rounding (2^-53) of another summation order, over 30 layers, stays orders of
    # magnitude below 1e-9 of the largest entry; rows, positions or keys mixed up between
    # prompts change whole entries
    err = float((got - want).abs().max())
    assert err <= 1e-9 * float(want.abs().max()), f"{what}: off by {err:.3g}"


@pytest.mark.parametrize("chunk_tokens", [0, EXEC_BLOCK])
def test_shared_mode_agrees_with_the_lone_prefill_to_rounding(smollm_fp64, chunk_tokens):
    model = smollm_fp64
    prompts = _prompts(model, LENGTHS if chunk_tokens == 0 else CHUNKED, seed=2)
    hs, caches = _batched_prefill(model, prompts, invariant=False, chunk_tokens=chunk_tokens)
    _check_lone(model, prompts, hs, caches, _close)


def test_shared_mode_returns_each_segments_own_keys(smollm_fp64):
    model = smollm_fp64
    prompts = _prompts(model, [9, 4], seed=3)
    segs = [Segment(embed(model, ids)) for ids in prompts]
    outs = layer_forward_batch(model, 0, segs)
    for ids, out in zip(prompts, outs):
        ref = prefill(model, ids, boundaries=[1])
        assert out.keys.shape == ref.keys[0].shape and out.h.shape == (len(ids), 576)
        _close(out.keys, ref.keys[0], "K")
        _close(out.values, ref.values[0], "V")
        _close(out.h, ref.hidden[1], "h_1")


def test_bad_segments_are_named(smollm_fp32):
    model = smollm_fp32
    h = torch.zeros(4, 576)
    cases = [
        ([], "segments: need at least one"),
        ([Segment(torch.zeros(4, 100))], r"segments\[0\]\.h: expected shape"),
        ([Segment(h), Segment(torch.zeros(0, 576))], r"segments\[1\]\.h: expected shape"),
        ([Segment(h.double())], r"segments\[0\]\.h: dtype"),
        ([Segment(h, pos=3, cache=_cache(model, 8))], r"segments\[0\]\.pos: must be"),
        ([Segment(h, pos=-EXEC_BLOCK)], r"segments\[0\]\.pos: must be"),
        ([Segment(h, pos=EXEC_BLOCK)], r"segments\[0\]\.cache: rows at position"),
        ([Segment(h, cache=_cache(model, 3))], r"segments\[0\]\.cache: rows \[0, 4\) exceed"),
    ]
    for segments, message in cases:
        with pytest.raises(ValueError, match=message):
            layer_forward_batch(model, 0, segments)
    with pytest.raises(ValueError, match=r"index: layer 30 is outside \[0, 30\)"):
        layer_forward_batch(model, 30, [Segment(h)])
