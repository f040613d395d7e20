"""Lynx's anchor and residual streams of a real `int8` layer (the embedded model's K and V): the two
streams rebuild the `int8` buffers bit for bit, so the layer decodes exactly as `int8`; the anchor
alone lies within 8 code steps (8 × the group's scale) of the `int8` values, and no closer than 4
somewhere (the bound is not vacuous); the two streams' bytes are the `int8` layer's, split as the
formula says."""

import pytest
import torch

from rekv_core.codecs import get_codec
from rekv_core.codecs.lynx import anchor_kv, merge_layer, split_layer, stream_bytes
from rekv_core.kernels import GROUP_SIZE
from rekv_core.model import prefill


@pytest.fixture(scope="module")
def layer_kv(smollm_fp32):
    ids = torch.randint(1000, 40000, (300,), generator=torch.Generator().manual_seed(5))
    out = prefill(smollm_fp32, ids, boundaries=())
    return out.keys[3], out.values[3]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_both_streams_rebuild_the_int8_layer_and_the_anchor_is_within_eight_steps(layer_kv,
                                                                                 backend):
    k, v = layer_kv
    codec = get_codec("int8")
    encoded = codec.encode(k, v)
    anchor, residual = split_layer(encoded.buffers, backend)
    merged = merge_layer(anchor, residual, backend)
    assert merged.keys() == encoded.buffers.keys()
    assert all(torch.equal(merged[name], encoded.buffers[name]) for name in merged)
    full = codec.decode(encoded)
    approx = anchor_kv(anchor, tuple(k.shape), torch.float32, backend)
    for half, exact, rough in zip(("k", "v"), full, approx):
        scales = anchor[f"{half}.scales"].view(torch.float16).float()
        error = (rough - exact).abs().reshape(-1, GROUP_SIZE) / scales[:, None]
        assert error.max() <= 8 + 1e-3
        assert error.max() >= 4


def test_the_streams_bytes_are_the_int8_layers_split(layer_kv):
    k, v = layer_kv
    encoded = get_codec("int8").encode(k, v)
    anchor, residual = split_layer(encoded.buffers)
    want_anchor, want_residual = stream_bytes(tuple(k.shape))
    assert sum(b.numel() for b in anchor.values()) == sum(want_anchor)
    assert sum(b.numel() for b in residual.values()) == sum(want_residual) == k.numel()
    assert sum(want_anchor) + sum(want_residual) == sum(encoded.layer_bytes())
